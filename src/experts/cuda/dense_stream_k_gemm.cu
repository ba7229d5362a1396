// DenseStreamKGemm (dense_stream_k_gemm.h): CUTLASS's ungrouped Hopper
// GEMM with blockwise scaling (cooperative 128 x 128 x 128 tiles) under a
// stream-K tile scheduler whose locks reset themselves.
#include "experts/cuda/dense_stream_k_gemm.h"

#include <cutlass/barrier.h>
#include <cutlass/block_striped.h>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp>
#include <cutlass/gemm_coord.hpp>

#include <algorithm>
#include <string>

#include "experts/cuda/block_scaled_gemm.h"
#include "experts/cuda/block_scaled_gemm_sm90.cuh"

namespace moelink::detail::experts {

// The tag GemmUniversal takes for LockResettingStreamK (specialized below).
struct LockResettingStreamKTag {};

// CUTLASS's stream-K scheduler with two changes to how the CTAs sharing an
// output tile add up their fp32 accumulators (its fixup):
// - Split-K (splits > 1): CUTLASS's deterministic fixup is a chain: slice s
//   waits until slice s - 1 has added its accumulators into the tile's one
//   slot in the workspace, then adds its own, so a tile of S slices pays S -
//   1 round trips through L2 one after another (measured on an H100: qkv_a
//   at one token took 20 us in 4 slices, 26 in 8, against 13 on the tiled
//   kernels). Here each slice but the last stores its accumulators into a
//   slot of its own at once and arrives on the tile's lock; the last waits
//   for all S - 1, then adds the slots to its accumulators in slice order
//   (a fixed order: the results are deterministic) and runs the epilogue.
//   Workspace: the locks (a u32 per tile and consumer warpgroup), then
//   tiles x (S - 1) slots of 128 x 128 fp32.
// - Either way the lock is left zero by the CTA that waited on it last (the
//   last slice, once it has seen every peer arrive: no one reads that lock
//   again in the launch), where CUTLASS's host code zeroes the locks before
//   every launch (a memset between the kernels: no programmatic launch, one
//   more graph node a GEMM). So each launch leaves the workspace's locks as
//   it found them: zero.
// Stream-K (splits 1) keeps CUTLASS's fixup and layout (partial tiles, then
// the locks), with the reset added.
template <class TileShape, class ClusterShape>
class LockResettingStreamK
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>;
  static constexpr uint64_t kTileElements = cute::size<0>(TileShape{}) * cute::size<1>(TileShape{});
  // CUTLASS's own barriers for the fixup (as Base::fixup names them).
  using BarrierManager =
      cutlass::NamedBarrierManager<cutlass::NumThreadsPerWarpGroup,
                                   static_cast<uint32_t>(cutlass::arch::ReservedNamedBarriers::StreamkBarrier0), 2>;

 public:
  using Base::Base;
  using typename Base::Arguments;
  using typename Base::BarrierType;
  using typename Base::Params;
  using typename Base::WorkTileInfo;

  // Bytes of the split-K locks: one per tile and consumer warpgroup, padded
  // to a 128-byte line so that the slots after them stay aligned.
  CUTLASS_HOST_DEVICE static size_t split_lock_bytes(uint64_t tiles, uint32_t warp_groups) {
    return (tiles * warp_groups * sizeof(BarrierType) + 127) / 128 * 128;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const& args, ProblemShape problem_shape,
                                   cutlass::KernelHardwareInfo const& hw_info, uint32_t mma_warp_groups,
                                   const uint32_t epilogue_subtile = 1, uint32_t num_accumulator_mtxs = 1) {
    const size_t base = Base::template get_workspace_size<ProblemShape, ElementAccumulator>(
        args, problem_shape, hw_info, mma_warp_groups, epilogue_subtile, num_accumulator_mtxs);
    if (args.splits <= 1) return base;
    const auto mnkl = cute::append<4>(problem_shape, 1);
    const uint64_t tiles = cute::ceil_div(cute::size<0>(mnkl), cute::size<0>(TileShape{})) *
                           cute::ceil_div(cute::size<1>(mnkl), cute::size<1>(TileShape{})) * cute::size<3>(mnkl);
    // CUTLASS may lower the split count (never raise it): size for the asked one.
    const size_t split = split_lock_bytes(tiles, mma_warp_groups) +
                         tiles * (args.splits - 1) * kTileElements * sizeof(ElementAccumulator);
    return std::max(base, split);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& work, FrgTensorC& accumulators,
                                   uint32_t num_barriers, uint32_t barrier_idx) {
    if (params.divmod_splits_.divisor > 1) {
      split_k_fixup(params, work, accumulators, num_barriers, barrier_idx);
      return;
    }
    Base::fixup(params, work, accumulators, num_barriers, barrier_idx);
    if (!Base::requires_fixup(params, work) || params.requires_separate_reduction() ||
        !Base::compute_epilogue(work, params))
      return;
    // Base::fixup's final split waited (its warpgroup's thread 0, then the
    // warpgroup's barrier) for the lock to reach its K offset: every peer
    // has arrived. The locks follow the partial tiles, as Base::fixup lays
    // them out.
    const uint64_t lock_idx = Base::output_tile_index(params, work) * num_barriers + barrier_idx;
    const size_t partial_bytes = Params::get_reduction_workspace_size(
        params.sk_tiles_, cutlass::gemm::to_gemm_coord(TileShape{}),
        cutlass::sizeof_bits<typename FrgTensorC::value_type>::value);
    auto* locks = reinterpret_cast<BarrierType*>(static_cast<uint8_t*>(params.reduction_workspace_) + partial_bytes);
    if (threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0) locks[lock_idx] = 0;
  }

 private:
  // The slice whose K range starts at k-tile `k_idx` of its tile: CUTLASS
  // gives the first big_units_ slices one k-tile more than the others.
  CUTLASS_DEVICE static uint32_t split_index(Params const& params, uint32_t k_idx) {
    const uint32_t per = params.divmod_k_tiles_per_sk_unit_.divisor, big = params.big_units_;
    return k_idx < big * (per + 1) ? k_idx / (per + 1) : big + (k_idx - big * (per + 1)) / per;
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE static void split_k_fixup(Params const& params, WorkTileInfo const& work,
                                           FrgTensorC& accumulators, uint32_t num_barriers, uint32_t barrier_idx) {
    if (!Base::requires_fixup(params, work)) return;
    using Accumulator = typename FrgTensorC::value_type;
    using AccumulatorArray = cutlass::Array<Accumulator, cute::size(FrgTensorC{})>;
    using Stripes = cutlass::BlockStripedReduce<BarrierManager::ThreadCount, AccumulatorArray>;
    const uint32_t splits = params.divmod_splits_.divisor;
    const uint64_t tile = Base::output_tile_index(params, work);
    const uint64_t lock_idx = tile * num_barriers + barrier_idx;
    const int thread = threadIdx.x % BarrierManager::ThreadCount;
    auto* locks = static_cast<BarrierType*>(params.reduction_workspace_);
    auto* slots = reinterpret_cast<Accumulator*>(static_cast<uint8_t*>(params.reduction_workspace_) +
                                                 split_lock_bytes(params.units_per_problem_, num_barriers));
    // Slot s of this tile, this warpgroup's half.
    auto slot = [&](uint32_t s) {
      return reinterpret_cast<AccumulatorArray*>(slots + (tile * (splits - 1) + s) * kTileElements +
                                                 cute::size(accumulators) * barrier_idx * BarrierManager::ThreadCount);
    };
    auto* mine = reinterpret_cast<AccumulatorArray*>(accumulators.data());
    if (!Base::compute_epilogue(work, params)) {
      Stripes::store(slot(split_index(params, work.K_idx)), *mine, thread);
      BarrierManager::arrive_inc(barrier_idx, locks, thread, lock_idx, 1);
      return;
    }
    // The last slice: every other one has stored (wait, and leave the lock 0).
    BarrierManager::wait_eq_reset(barrier_idx, locks, thread, lock_idx, splits - 1);
    for (uint32_t s = 0; s + 1 < splits; ++s) Stripes::load_add(*mine, slot(s), thread);
  }
};

}  // namespace moelink::detail::experts

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<moelink::detail::experts::LockResettingStreamKTag, arch::Sm90, TileShape, ClusterShape,
                             Stages> {
  using Scheduler = moelink::detail::experts::LockResettingStreamK<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace moelink::detail::experts {
namespace {

// The kernel: A = x [m, k] row-major, B = w [n, k] (k contiguous), D = y
// [m, n] row-major bf16, scales K-major with granularity 1 x 128 x 128 (the
// same operands as the grouped kernels' unswapped tiles).
struct DenseKernel {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using ProblemShape = cute::Shape<int, int, int, int>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16;  // fp8 elements of 16 bytes: TMA's rule
  static constexpr int kAlignD = 8;

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlign,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = ProgrammaticGemmKernel<cutlass::gemm::kernel::GemmUniversal<
      ProblemShape, CollectiveMainloop, CollectiveEpilogue, LockResettingStreamKTag>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using K = DenseKernel;
using Decomposition = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;

class Sm90DenseStreamKGemm final : public DenseStreamKGemm {
 public:
  Sm90DenseStreamKGemm() {
    MOELINK_CUDA_CHECK(cudaGetDevice(&device_));
    cudaDeviceProp prop{};
    MOELINK_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    if (prop.major != 9)
      throw InvalidArgument("moelink: Experts: the CUDA expert kernels need a Hopper GPU (sm_90); device " +
                            std::to_string(device_) + " (" + prop.name + ") is sm_" +
                            std::to_string(prop.major) + std::to_string(prop.minor));
    sm_count_ = prop.multiProcessorCount;
    // The kernel's shared memory, set once here rather than in a call that
    // may be inside another stream's capture.
    const int smem = static_cast<int>(K::Kernel::SharedStorageSize);
    MOELINK_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<K::Kernel>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }

  size_t workspace_bytes(const DenseGemmArgs& a, DenseSchedule s) const override {
    return K::Gemm::get_workspace_size(arguments(a, s));
  }

  void run(const DenseGemmArgs& a, DenseSchedule s, void* workspace, cudaStream_t stream,
           bool programmatic) override {
    const typename K::Gemm::Arguments args = arguments(a, s);
    if (K::Gemm::can_implement(args) != cutlass::Status::kSuccess)
      throw InvalidArgument("moelink: Experts: CUTLASS cannot run the dense stream-K GEMM for m " +
                            std::to_string(a.m) + ", n " + std::to_string(a.n) + ", k " + std::to_string(a.k));
    // Params only (no workspace initialization: the locks are already zero,
    // LockResettingStreamK keeps them so).
    typename K::Kernel::Params params = K::Kernel::to_underlying_arguments(args, workspace);
    const cutlass::Status st = K::Gemm::run(params, stream, nullptr, programmatic);
    if (st != cutlass::Status::kSuccess)
      throw SystemError(std::string("moelink: Experts: CUTLASS dense stream-K GEMM launch failed: ") +
                        cutlass::cutlassGetStatusString(st) + " (" + cudaGetErrorString(cudaGetLastError()) + ")");
  }

 private:
  typename K::Gemm::Arguments arguments(const DenseGemmArgs& a, DenseSchedule s) const {
    const int m = static_cast<int>(a.m), n = a.n, k = a.k;
    typename K::Kernel::StrideA sa{};
    typename K::Kernel::StrideB sb{};
    typename K::Kernel::StrideD sd{};
    cute::get<0>(sa) = a.x_row_stride;
    cute::get<0>(sb) = a.w_row_stride;
    cute::get<0>(sd) = a.y_row_stride;
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device_;
    hw.sm_count = sm_count_;
    typename K::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const K::ElementA*>(a.x), sa, static_cast<const K::ElementB*>(a.w), sb, a.x_scale,
         K::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1)), a.w_scale,
         K::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1))},
        {{}, nullptr, sd, static_cast<K::ElementD*>(a.y), sd},
        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.scheduler.splits = std::max(1, s.splits);
    args.scheduler.decomposition_mode = s.splits > 1 ? Decomposition::SplitK : Decomposition::StreamK;
    return args;
  }

  int device_ = 0, sm_count_ = 0;
};

}  // namespace

int dense_split_for(int64_t m, int64_t n, int64_t k, int sm_count) {
  // Measured on an H100 (dense_gemm_bench.py --stream-k; docs/experts.md):
  // this kernel costs about 15 us whatever its slices (qkv_a at 1-32 rows:
  // 16.7 us in 7 slices, 16.9 in 4), where the swapped-operand tiles take
  // 12.6-12.9 and o_proj's 64-row tiles 47.6 against 52.4: it pays from 65
  // rows (the 128-row tiles: qkv_a 24.4 -> 14.9 us at 128 rows, 16.4 at 256;
  // o_proj 57.4 -> 51.5 at 128). More than 4 slices gained nothing (15.9 us
  // in 7 at 128 rows), and a second wave of CTAs lost (256 rows in 4: 20.0).
  // The kernel's 128 x 128 output tiles: kRows128's extent.
  const int64_t tiles = gemm_tile_count(GemmTiles::kRows128, 1, m, n), k_blocks = k / 128;
  if (m <= 64 || 2 * tiles > sm_count) return 1;
  const int64_t splits = std::min<int64_t>({sm_count / tiles, k_blocks / 4, 4});
  return splits >= 2 ? static_cast<int>(splits) : 1;
}

std::unique_ptr<DenseStreamKGemm> make_dense_stream_k_gemm() { return std::make_unique<Sm90DenseStreamKGemm>(); }

}  // namespace moelink::detail::experts
