// A dynamic tile scheduler for the cooperative grouped GEMMs without
// clusters: the swapped-operand (decode) tiles and the 128-row tiles.
//
// CUTLASS's group scheduler (PersistentTileSchedulerSm90Group) deals CTA b
// the tiles b, b + grid, b + 2 grid, ... before the kernel starts. A decode
// GEMM streams weights, and CTAs stream at different rates (an H200 timeline
// of L = 8's GEMM2, 112 CTAs of 4 tiles: CTAs finish 27.7 to 35.0 us after
// starting, median 30.2), so the GEMM ends with its slowest CTA. This
// scheduler keeps each CTA's first tile (its CTA index) and hands out the
// rest from a counter in global memory, one tile at a time: a CTA asks for
// its next tile when it starts the previous one, so faster CTAs take more.
// It pays where CTAs have many tiles: 32 experts take 2 % off a decode
// forward up to 32 rows (8 to 14 tiles a CTA) and 5 % at 128 rows (the
// 128-row tiles, about 8 a CTA); with 2 to 4 a CTA (8 experts) whole tiles
// are too coarse to even the CTAs out.
//
// CUTLASS's grouped kernels already route tiles through a scheduler warp
// and a shared-memory pipeline to the other warps; this class replaces only
// the scheduler warp's advance_to_next_work. That pipeline is 8 deep, which
// would let a CTA claim 8 tiles at once, so a claim first waits until the
// CTA's consumers have taken the previous tile. The counter lives in the
// GEMM's workspace; the argument kernel before each launch zeroes it
// (Params::next_tile). (Counting the CTAs that ran out, to let the last
// one reset it, does not work: a CTA whose first tile is past the end
// returns before its scheduler warp starts.)
//
// Used for cooperative kernels with single-CTA clusters only (the tiles of
// a cluster must stay together for multicast; ping-pong kernels consume the
// pipeline differently): TileSchedulerSelector is specialized below for
// tiles 128 rows tall, which only those kernels use (ping-pong tiles are 64).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace moelink::detail::experts {

template <class GroupProblemShape, int Stages>
class DynamicGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, Stages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, Stages>;

 public:
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  struct Arguments : Base::Arguments {
    bool dynamic = true;  // false: CUTLASS's static order (A/B runs)
  };

  struct Params : Base::Params {
    // Tiles handed out after each CTA's first; zero when a launch starts.
    // Null: CUTLASS's static order.
    uint32_t* next_tile = nullptr;
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(GroupProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        uint32_t epilogue_subtile = 1, uint32_t ktile_start_alignment = 1u) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, tile_shape, cluster_shape, hw_info, arguments,
                                      workspace, epilogue_subtile, ktile_start_alignment);
    p.next_tile = arguments.dynamic ? static_cast<uint32_t*>(workspace) : nullptr;
    return p;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(typename Base::Arguments const&, ProblemShape,
                                   cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                   uint32_t = 1) {
    return sizeof(uint32_t);
  }

  DynamicGroupScheduler() = default;

  CUTLASS_DEVICE DynamicGroupScheduler(Params const& params, SchedulerResponse* response)
      : Base(params, response), next_tile_(params.next_tile) {
#if defined(__CUDA_ARCH__)
    grid_ctas_ = gridDim.x * gridDim.y * gridDim.z;
#endif
  }

  // Called by the whole scheduler warp, once per tile after the first, until
  // it returns an invalid tile.
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           uint32_t advance_count = 1) {
    if (next_tile_ == nullptr) return Base::advance_to_next_work(pipeline, state, advance_count);
    // The slot this pipeline reuses Stages - 1 claims later is the previous
    // claim's: acquiring it ahead waits until the consumers took that tile.
    PipelineState previous = state;
    previous += Stages - 1;
    pipeline.producer_acquire(previous);
    const int lane = cutlass::canonical_lane_idx();
    uint64_t linear = 0;
    if (lane == 0) linear = grid_ctas_ + atomicAdd(next_tile_, 1u);
    linear = __shfl_sync(0xffffffffu, linear, 0);
    WorkTileInfo work = this->get_current_work_for_linear_idx(linear);  // warp-wide
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  uint32_t* next_tile_ = nullptr;
  uint32_t grid_ctas_ = 0;
};

}  // namespace moelink::detail::experts

namespace cutlass::gemm::kernel::detail {

// The cooperative tiles of 128 x N x 128 (the swapped-operand tiles, 128
// weight rows by 32 token rows; the 128-row tiles) in a single-CTA cluster:
// moelink's DynamicGroupScheduler instead of CUTLASS's group scheduler.
template <class TileN, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, cute::Shape<cute::_128, TileN, cute::_128>,
                             cute::Shape<cute::_1, cute::_1, cute::_1>, Stages,
                             cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>> {
  using Scheduler = moelink::detail::experts::DynamicGroupScheduler<
      cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>, Stages>;
};

}  // namespace cutlass::gemm::kernel::detail
