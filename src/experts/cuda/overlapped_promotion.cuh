// A consumer mainloop for CUTLASS's Hopper blockwise-scaled fp8 GEMM that
// keeps the tensor cores busy while the previous k-tile is promoted.
//
// Why: with 1 x 128 / 128 x 128 block scales, every 128-deep k-tile's wgmma
// partial sums must be scaled (x_scale * w_scale) and added to the fp32
// accumulators ("promotion"). CUTLASS's mainloop (sm90_mma_array_tma_gmma_ss_
// warpspecialized_fp8_blockwise_scaling.hpp) waits for a k-tile's wgmma to
// finish, promotes, and only then issues the next k-tile, so the tensor
// cores idle for every promotion: Nsight Compute put its tensor pipe at 74 %
// on DeepSeek-V3's prefill GEMM1 (L = 32, m = 2048).
//
// Here the partial sums alternate between two register tiles: k-tile t + 1's
// wgmma is issued into one while k-tile t's, in the other, is promoted
// (wgmma.wait_group 1 instead of 0). Costs one more accumulator tile of
// registers per thread (64 fp32 for a warpgroup's 64 x 128 share), which the
// consumer warpgroups' 232 registers hold.
//
// Everything else (producer, TMA, the scales' cp.async loads into shared
// memory, the pipeline, the epilogue) is CUTLASS's: this class derives from
// the collective the builder returns and replaces only its consumer `mma`.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace moelink::detail::experts {

template <class Base>
struct OverlappedPromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;

  // One promotion per k-tile, and one operand's scale constant over the
  // tile (w's 128 x 128 blocks): the per-element scale is then the other
  // operand's row (or column) scale times that constant.
  static_assert(Base::ScaleGranularityK == cute::size<2>(TileShape{}),
                "one block scale along K per k-tile");
  static_assert(Base::ScaleMsPerTile == 1 || Base::ScaleNsPerTile == 1,
                "one operand's scale must be constant over a tile");
  static constexpr bool kRowScales = Base::ScaleNsPerTile == 1;  // A's scales vary along M

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& /*mainloop_params*/) {
    using namespace cute;
    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    // The scales in shared memory seen as (BLK_M, BLK_N, (scale K, PIPE)):
    // A's broadcast along N, B's along M, so the accumulators' partition
    // gives each thread the scales of its own elements.
    cute::Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    cute::Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    TiledMma tiled_mma;
    // wgmma operands are partitioned per warpgroup, the accumulators per thread.
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto group_mma = tiled_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    auto thread_mma = tiled_mma.get_slice(thread_idx);
    cute::Tensor tCrA = group_mma.make_fragment_A(group_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    cute::Tensor tCrB = group_mma.make_fragment_B(group_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)
    cute::Tensor tCsSFA = thread_mma.partition_C(sSFA);  // (MMA,MMA_M,MMA_N,(scale K,PIPE))
    cute::Tensor tCsSFB = thread_mma.partition_C(sSFB);
    auto varying_scales = [&](int stage) {
      if constexpr (kRowScales)
        return tCsSFA(_, _, _, make_coord(_0{}, stage));
      else
        return tCsSFB(_, _, _, make_coord(_0{}, stage));
    };
    auto constant_scale = [&](int stage) -> float {
      if constexpr (kRowScales)
        return tCsSFB(0, 0, 0, make_coord(0, stage));
      else
        return tCsSFA(0, 0, 0, make_coord(0, stage));
    };

    // Two partial-sum tiles and their scales (registers only for the
    // distinct values: the scale tensors keep their broadcast strides).
    cute::Tensor partial0 = make_fragment_like(accum);
    cute::Tensor partial1 = make_fragment_like(accum);
    cute::Tensor scale0 = make_tensor_like<float>(varying_scales(0));
    cute::Tensor scale1 = make_tensor_like<float>(varying_scales(0));

    // A k-tile's combined scales, read from its stage before the stage is freed.
    auto load_scales = [&](int stage, auto& scale) {
      copy(varying_scales(stage), scale);
      const float c = constant_scale(stage);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(scale)); ++i) filter_zeros(scale)(i) *= c;
    };
    // The k-tile's wgmma into `partial` (overwritten), committed as one batch.
    auto issue = [&](int stage, auto& partial) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(partial);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), partial);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(partial);
    };
    auto promote = [&](auto& partial, auto& scale) {
      warpgroup_fence_operand(partial);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * scale(i);
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    clear(accum);
    warpgroup_fence_operand(accum);
    if (k_tile_count <= 0) return;

    auto wait_full = [&] {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
    };
    wait_full();
    load_scales(smem_pipe_read.index(), scale0);
    issue(smem_pipe_read.index(), partial0);
    ++smem_pipe_read;
    --k_tile_count;

    // Issue the next k-tile into `next`, then promote `prev` once its
    // batch is done (at most one batch, next's, still in flight). The
    // stage of the last k-tile is released by mma_tail, as CUTLASS's is.
    auto step = [&](auto& next, auto& next_scale, auto& prev, auto& prev_scale) {
      wait_full();
      load_scales(smem_pipe_read.index(), next_scale);
      issue(smem_pipe_read.index(), next);
      warpgroup_wait<1>();
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      promote(prev, prev_scale);
      ++smem_pipe_read;
    };
    // Unrolled by two so that each tile stays in fixed registers.
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count >= 2; k_tile_count -= 2) {
      step(partial1, scale1, partial0, scale0);
      step(partial0, scale0, partial1, scale1);
    }
    if (k_tile_count == 1) {
      step(partial1, scale1, partial0, scale0);
      warpgroup_wait<0>();
      promote(partial1, scale1);
    } else {
      warpgroup_wait<0>();
      promote(partial0, scale0);
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace moelink::detail::experts
