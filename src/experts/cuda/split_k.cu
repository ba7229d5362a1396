// The split over K for GEMMs with few output tiles (block_scaled_gemm.h):
// with a handful of token rows, a shared expert's 4096 x 7168 GEMM has 32
// tiles of 128 weight rows for 132 SMs; cut into 4 slices of K it has 128,
// each streaming a quarter of the weights. The slices' fp32 partial sums are
// added by a small kernel that rounds once to bf16, as the unsplit GEMM does.
// A dense GEMM of more rows can split its 128-row tiles the same way
// (split_k_rows128.cu), forced only (MOELINK_EXPERTS_SPLIT_K).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "core/layout.h"
#include "experts/cuda/gemm_tile_configs.cuh"
#include "nvlink/cuda_check.h"

namespace moelink::detail::experts {
namespace {

__device__ inline int64_t group_rows(const GemmOperands& op, int g) {
  bool bad = false;  // the GEMM's write_group_arguments reports it
  return clamp_m(op.counts ? op.counts[g] : static_cast<int32_t>(op.capacity), op.capacity, &bad);
}

// Thread (x, y, g): columns 4 (x blockDim.x + thread) .. + 3 of group g's
// rows y, y + gridDim.y, ... (a decode GEMM has a handful of rows: the
// columns carry the parallelism).
__global__ void split_reduce_kernel(GemmOperands op) {
  begin_programmatic_kernel();
  const int g = blockIdx.z, L = op.groups, v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= op.n / 4) return;
  const int64_t rows = group_rows(op, g);
  auto* y = static_cast<__nv_bfloat16*>(op.y) + g * op.y_group_stride;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < op.split_k; ++s) {
      const float4 p = reinterpret_cast<const float4*>(
          op.partial + (static_cast<int64_t>(s * L + g) * op.capacity + r) * op.n)[v];
      acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
    uint2 out;
    out.x = *reinterpret_cast<const uint32_t*>(&lo);
    out.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(y + r * op.y_row_stride + 4 * v) = out;
  }
}

}  // namespace

GemmTiles split_k_tiles(GemmTiles tiles) {
  return tiles == GemmTiles::kSwap128N32 ? GemmTiles::kSwap128N32 : GemmTiles::kRows128;
}

std::unique_ptr<BlockScaledGemm> make_split_k_gemm(GemmTiles tiles, int groups, GemmGrid grid) {
  if (split_k_tiles(tiles) == GemmTiles::kRows128) return make_split_k_rows128_gemm(groups, grid);
  return std::make_unique<Sm90BlockScaledGemm<SplitKKernel>>(GemmTiles::kSwap128N32, groups, grid);
}

int split_k_for(int64_t tiles, int64_t k_blocks, int sm_count) {
  // In k-blocks of one wave (about 0.5 us on an H200): a tile's pipeline
  // fill and epilogue, and a split's fp32 partials and reduce kernel.
  // Fitted to experts_bench.py --split-k (bench/results): split 4 gains on
  // a shared expert's 4096 x 7168 GEMM1 (32 tiles, 56 k-blocks: 24 -> 16 us
  // at m = 1), split 2 loses on its 7168 x 2048 GEMM2 (56 tiles, 16 k-blocks:
  // 12.4 -> 14.0 us), and any split loses with 8 or 32 experts. Counts
  // other than 2, 4 and 8 (7 of DeepSeek-V3's 56 k-blocks, one wave of 119
  // tiles for qkv_a's 17) are not fitted: a split GEMM pays about 10 us
  // more than these waves say (docs/experts.md), so they stay forced-only.
  constexpr double kFill = 8, kSplitCost = 6;
  auto cost = [&](int s) {
    return std::ceil(static_cast<double>(tiles * s) / sm_count) * (static_cast<double>(k_blocks) / s + kFill) +
           (s > 1 ? kSplitCost : 0);
  };
  int best = 1;
  for (int s : {2, 4, 8})
    if (k_blocks % s == 0 && k_blocks / s >= 4 && cost(s) <= 0.85 * cost(1) && cost(s) < cost(best))
      best = s;
  return best;
}

void launch_split_reduce(const GemmOperands& op, cudaStream_t stream, bool programmatic) {
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>((op.n / 4 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(op.capacity, 32)), static_cast<unsigned>(op.groups));
  launch_expert_kernel(split_reduce_kernel, grid, dim3(kThreads), 0, stream, programmatic, op);
}

}  // namespace moelink::detail::experts
