// BlockScaledGemm on CUTLASS's Hopper grouped GEMM with blockwise scaling
// (cutlass/gemm/collective/sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_
// blockwise_scaling.hpp). Included by one .cu per tile configuration, so
// each CUTLASS kernel compiles in its own translation unit (in parallel).
#pragma once

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>

#include "experts/cuda/block_scaled_gemm.h"
#include "experts/cuda/device_buffer.h"
#include "experts/cuda/dynamic_group_scheduler.cuh"
#include "experts/cuda/expert_error_device.cuh"
#include "experts/cuda/overlapped_promotion.cuh"
#include "experts/cuda/programmatic_launch.cuh"
#include "nvlink/cuda_check.h"

namespace moelink::detail::experts {

// Options of a kernel (Sm90BlockScaledKernel's kOptions), or-ed.
enum KernelOptions : unsigned {
  // D^T = w . x^T: A = w [N, K], B = x [rows, K], D = y^T (column-major
  // [N, rows], i.e. y row-major); scale granularity 128 x 1 x 128. A tile
  // then holds 64 or 128 weight rows and only 16 or 32 token rows, which
  // fits decode, where a GEMM has a handful of rows per expert. Without it:
  // A = x [rows, K] fp8 (row-major), B = w [N, K] (K contiguous:
  // "column-major" B), D = y [rows, N] bf16 row-major; granularity 1 x 128 x 128.
  kSwapOperands = 1,
  // CUTLASS's consumer mainloop replaced by OverlappedPromotionMainloop (the
  // next k-tile's wgmma in flight while the previous one is promoted).
  kOverlapPromotion = 2,
};

// A CUTLASS kernel that begins with begin_programmatic_kernel(), so that it
// may be launched with PDL (programmatic_launch.cuh). CUTLASS 4.2's grouped
// SM90 kernels do not wait on the grid dependency themselves; waiting before
// the whole kernel, rather than before its first load, also covers the
// argument arrays it reads first.
template <class Base>
struct ProgrammaticGemmKernel : Base {
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, char* smem) {
    begin_programmatic_kernel();
    Base::operator()(params, smem);
  }
};

// The CUTLASS kernel for one tile configuration. Scales K-major: x_scale
// rows of K/128 floats, w_scale rows of K/128 floats per 128 rows of w (the
// checkpoint's weight_scale_inv layout). No C operand. ElementD: bf16 (y),
// or fp32 for the partial sums of a split over K.
template <class TileShape, class ClusterShape_, class KernelSchedule, class EpilogueSchedule,
          unsigned kOptions, class ElementD_ = cutlass::bfloat16_t>
struct Sm90BlockScaledKernel {
  static constexpr bool kSwap = (kOptions & kSwapOperands) != 0;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = ElementD_;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignA = 16;  // elements of 16 bytes: TMA's rule
  static constexpr int kAlignB = 16;
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(ElementD));
  using ClusterShape = ClusterShape_;  // 2 x 1: B tiles multicast to the two CTAs

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      kSwap ? 128 : 1, kSwap ? 1 : 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<(kOptions & kOverlapPromotion) != 0,
                                                OverlappedPromotionMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel = ProgrammaticGemmKernel<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>>;
  // moelink's DynamicGroupScheduler (the cooperative 128-row tiles without
  // clusters: dynamic_group_scheduler.cuh) rather than CUTLASS's.
  static constexpr bool kDynamicTiles =
      std::is_same_v<typename Kernel::TileScheduler, DynamicGroupScheduler<ProblemShape, 8>>;
  static_assert(!kSwap || kDynamicTiles,
                "the swapped-operand tiles should use moelink's DynamicGroupScheduler");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Problem = typename ProblemShape::UnderlyingProblemShape;
};

// CUTLASS's per-group argument arrays, carved from one device allocation.
template <class K>
struct GroupArguments {
  typename K::Problem* problem;
  const typename K::ElementA** a;
  const typename K::ElementB** b;
  typename K::ElementD** d;
  const float** sfa;
  const float** sfb;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  typename K::LayoutSFA* layout_sfa;
  typename K::LayoutSFB* layout_sfb;
};

// Split over K: the scales of group g dealt to the slices' packed rows
// (GemmOperands.x_scale_split, w_scale_split), by threads `first`,
// first + stride, ... The mainloop reads scale rows of k / split_k / 128
// values, so a slice cannot point into the unsplit rows.
__device__ inline void pack_split_scales(const GemmOperands& op, int g, int64_t rows, int first,
                                         int stride) {
  const int L = op.groups, kb = op.k / 128, kbs = kb / op.split_k, nb = op.n / 128;
  const int x_values = static_cast<int>(rows) * kb;
  for (int i = first; i < x_values; i += stride) {
    const int r = i / kb, c = i - r * kb, s = c / kbs;
    op.x_scale_split[(static_cast<int64_t>(s * L + g) * op.capacity + r) * kbs + (c - s * kbs)] =
        op.x_scale[g * op.x_scale_group_stride + i];
  }
  for (int i = first; i < nb * kb; i += stride) {
    const int r = i / kb, c = i - r * kb, s = c / kbs;
    op.w_scale_split[(static_cast<int64_t>(s * L + g) * nb + r) * kbs + (c - s * kbs)] =
        op.w_scale[g * op.w_scale_group_stride + i];
  }
}

// The argument arrays of one GEMM object and what to write into them.
template <class K>
struct ArgumentsJob {
  GroupArguments<K> args;
  GemmOperands op;
  int groups;
  uint32_t* next_tile;  // DynamicGroupScheduler's counter, or null
};

// One thread per group: the group's rows from the device counts (clamped
// and reported), its pointers and strides. Split over K (op.split_k > 1),
// group gs is slice gs / op.groups of group gs % op.groups, writing fp32
// partial sums (GemmOperands), and block (x, g) of the launch also packs
// group g's scales (pack_split_scales). Blocks with blockIdx.z == 1 write
// `second`'s arrays (two GEMM objects in one launch, never split).
template <class K>
__global__ void write_group_arguments(ArgumentsJob<K> first, ArgumentsJob<K> second,
                                      ExpertErrorRecord* error) {
  begin_programmatic_kernel();
  const ArgumentsJob<K>& job = blockIdx.z == 0 ? first : second;
  const GroupArguments<K>& args = job.args;
  const GemmOperands& op = job.op;
  const int groups = job.groups;
  uint32_t* next_tile = job.next_tile;
  // The GEMM's DynamicGroupScheduler counts from 0 in every launch.
  if (next_tile != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *next_tile = 0;
  if (op.split_k > 1) {
    const int g = blockIdx.y;
    bool clamped = false;  // reported below, by the group's argument thread
    const int64_t rows =
        clamp_m(op.counts ? op.counts[g] : static_cast<int32_t>(op.capacity), op.capacity, &clamped);
    pack_split_scales(op, g, rows, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  }
  const int gs = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  if (gs >= groups) return;
  const bool split = op.split_k > 1;
  const int g = split ? gs % op.groups : gs, slice = split ? gs / op.groups : 0;
  const int32_t seen = op.counts ? op.counts[g] : static_cast<int32_t>(op.capacity);
  bool bad = false;
  const int rows = static_cast<int>(clamp_m(seen, op.capacity, &bad));
  if (bad && slice == 0) record_expert_error(error, op.op, g, seen, op.capacity);

  const int k = split ? op.k / op.split_k : op.k;
  const auto* x = static_cast<const typename K::ElementA*>(op.x) + g * op.x_group_stride +
                  static_cast<int64_t>(slice) * k;
  const auto* w = static_cast<const typename K::ElementB*>(op.w) + g * op.w_group_stride +
                  static_cast<int64_t>(slice) * k;
  const int64_t kb = k / 128;
  const float* xs = split ? op.x_scale_split + gs * op.capacity * kb
                          : op.x_scale + g * op.x_scale_group_stride;
  const float* ws = split ? op.w_scale_split + gs * (op.n / 128) * kb
                          : op.w_scale + g * op.w_scale_group_stride;
  auto* d = split ? reinterpret_cast<typename K::ElementD*>(op.partial) + gs * op.capacity * op.n
                  : static_cast<typename K::ElementD*>(op.y) + g * op.y_group_stride;
  const int64_t d_row_stride = split ? op.n : op.y_row_stride;
  typename K::StrideA sa{};
  typename K::StrideB sb{};
  typename K::StrideD sd{};
  int m = rows, n = op.n;
  if constexpr (K::kSwap) {
    m = op.n, n = rows;
    args.a[gs] = w, args.b[gs] = x, args.sfa[gs] = ws, args.sfb[gs] = xs;
    cute::get<0>(sa) = op.w_row_stride;
    cute::get<0>(sb) = op.x_row_stride;
    cute::get<1>(sd) = d_row_stride;  // D = y^T, column-major
  } else {
    args.a[gs] = x, args.b[gs] = w, args.sfa[gs] = xs, args.sfb[gs] = ws;
    cute::get<0>(sa) = op.x_row_stride;
    cute::get<0>(sb) = op.w_row_stride;
    cute::get<0>(sd) = d_row_stride;
  }
  args.problem[gs] = typename K::Problem{m, n, k};
  args.d[gs] = d;
  args.stride_a[gs] = sa;
  args.stride_b[gs] = sb;
  args.stride_d[gs] = sd;
  // The mainloop derives the scale layouts from (M, N, K) itself (packed
  // K-major rows, hence the split's packed copies); these are kept
  // consistent for any reader of the arrays.
  args.layout_sfa[gs] = K::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  args.layout_sfb[gs] = K::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

template <class K>
class Sm90BlockScaledGemm final : public BlockScaledGemm {
 public:
  Sm90BlockScaledGemm(GemmTiles tiles, int groups, GemmGrid grid) : tiles_(tiles), groups_(groups) {
    int device = 0;
    MOELINK_CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    MOELINK_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    if (prop.major != 9)
      throw InvalidArgument("moelink: Experts: the CUDA expert kernels need a Hopper GPU (sm_90); "
                            "device " + std::to_string(device) + " (" + prop.name + ") is sm_" +
                            std::to_string(prop.major) + std::to_string(prop.minor));

    // Argument arrays: each part 128-byte aligned.
    size_t offset = 0;
    auto carve = [&](size_t bytes) {
      size_t at = offset;
      offset += (bytes + 127) / 128 * 128;
      return at;
    };
    const size_t g = static_cast<size_t>(groups);
    const size_t o_problem = carve(g * sizeof(typename K::Problem));
    const size_t o_a = carve(g * sizeof(void*)), o_b = carve(g * sizeof(void*));
    const size_t o_d = carve(g * sizeof(void*)), o_sfa = carve(g * sizeof(void*));
    const size_t o_sfb = carve(g * sizeof(void*));
    const size_t o_sa = carve(g * sizeof(typename K::StrideA));
    const size_t o_sb = carve(g * sizeof(typename K::StrideB));
    const size_t o_sd = carve(g * sizeof(typename K::StrideD));
    const size_t o_lsfa = carve(g * sizeof(typename K::LayoutSFA));
    const size_t o_lsfb = carve(g * sizeof(typename K::LayoutSFB));
    const size_t arrays_bytes = offset;
    arrays_ = device_alloc(arrays_bytes, true);
    char* base = static_cast<char*>(arrays_.get());
    args_.problem = reinterpret_cast<typename K::Problem*>(base + o_problem);
    args_.a = reinterpret_cast<const typename K::ElementA**>(base + o_a);
    args_.b = reinterpret_cast<const typename K::ElementB**>(base + o_b);
    args_.d = reinterpret_cast<typename K::ElementD**>(base + o_d);
    args_.sfa = reinterpret_cast<const float**>(base + o_sfa);
    args_.sfb = reinterpret_cast<const float**>(base + o_sfb);
    args_.stride_a = reinterpret_cast<typename K::StrideA*>(base + o_sa);
    args_.stride_b = reinterpret_cast<typename K::StrideB*>(base + o_sb);
    args_.stride_d = reinterpret_cast<typename K::StrideD*>(base + o_sd);
    args_.layout_sfa = reinterpret_cast<typename K::LayoutSFA*>(base + o_lsfa);
    args_.layout_sfb = reinterpret_cast<typename K::LayoutSFB*>(base + o_lsfb);

    // The kernel's parameters point at the arrays, never at the tensors, so
    // they are built once: a call only rewrites the arrays and launches.
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    // The persistent kernel's grid: `grid.ctas` blocks.
    hw.sm_count = grid.ctas > 0 ? std::min(grid.ctas, prop.multiProcessorCount) : prop.multiProcessorCount;
    typename K::Gemm::Arguments a{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, args_.problem, nullptr},  // problem sizes on the device only
        {args_.a, args_.stride_a, args_.b, args_.stride_b, args_.sfa, args_.layout_sfa, args_.sfb,
         args_.layout_sfb},
        {{}, nullptr, args_.stride_d, args_.d, args_.stride_d},
        hw};
    a.epilogue.thread.alpha = 1.0f;
    a.epilogue.thread.beta = 0.0f;
    if constexpr (K::kDynamicTiles) a.scheduler.dynamic = grid.dynamic;
    if (grid.raster_along_n) {
      a.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
      a.scheduler.max_swizzle_size = 8;
    }
    if (gemm_.can_implement(a) != cutlass::Status::kSuccess)
      throw InvalidArgument("moelink: Experts: CUTLASS cannot run the block-scaled GEMM (" +
                            std::string(gemm_tiles_name(tiles)) + ") here");
    const size_t workspace_bytes = K::Gemm::get_workspace_size(a);
    if (workspace_bytes > 0) workspace_ = device_alloc(workspace_bytes);
    cutlass::Status s = gemm_.initialize(a, workspace_.get());
    if (s != cutlass::Status::kSuccess)
      throw SystemError(std::string("moelink: Experts: CUTLASS GEMM initialize failed: ") +
                        cutlass::cutlassGetStatusString(s));
    device_bytes_ = arrays_bytes + workspace_bytes;
  }

  void write_arguments(const GemmOperands& op, ExpertErrorRecord* error, cudaStream_t stream,
                       bool programmatic, BlockScaledGemm* second,
                       const GemmOperands* second_op) override {
    const int threads = 128;
    dim3 grid((groups_ + threads - 1) / threads);
    if (op.split_k > 1) {
      // Blocks (x, g) pack group g's scales, enough for one value a thread.
      const int64_t values = std::max<int64_t>(op.capacity, op.n / 128) * (op.k / 128);
      grid = dim3(static_cast<unsigned>(std::min<int64_t>((values + threads - 1) / threads, 64)),
                  static_cast<unsigned>(op.groups));
    }
    const ArgumentsJob<K> first{args_, op, groups_, next_tile()};
    ArgumentsJob<K> other = first;
    if (second != nullptr) {
      auto* s = dynamic_cast<Sm90BlockScaledGemm*>(second);
      if (s == nullptr || second_op == nullptr || op.split_k > 1 || second_op->split_k > 1)
        throw InvalidArgument("moelink: Experts: two GEMMs' arguments are written together only "
                              "for objects of the same tiles, neither split over K");
      other = {s->args_, *second_op, s->groups_, s->next_tile()};
      grid.x = std::max(grid.x, static_cast<unsigned>((s->groups_ + threads - 1) / threads));
      grid.z = 2;
    }
    launch_expert_kernel(write_group_arguments<K>, grid, dim3(threads), 0, stream, programmatic,
                         first, other, error);
  }

  void launch(cudaStream_t stream, bool programmatic) override {
    cutlass::Status s = gemm_.run(stream, nullptr, programmatic);
    if (s != cutlass::Status::kSuccess)
      throw SystemError(std::string("moelink: Experts: CUTLASS GEMM launch failed: ") +
                        cutlass::cutlassGetStatusString(s) + " (" +
                        cudaGetErrorString(cudaGetLastError()) + ")");
  }

  GemmTiles tiles() const override { return tiles_; }
  size_t device_bytes() const override { return device_bytes_; }

 private:
  uint32_t* next_tile() {
    if constexpr (K::kDynamicTiles) return gemm_.params().scheduler.next_tile;
    return nullptr;
  }

  GemmTiles tiles_;
  int groups_;
  DeviceBuffer arrays_, workspace_;
  size_t device_bytes_ = 0;
  GroupArguments<K> args_{};
  typename K::Gemm gemm_;
};

}  // namespace moelink::detail::experts
