// Pieces both of moelink's MLA decode kernels use (mla_decode_tc.cu on
// mma.sync, mla_decode_wgmma.cu on Hopper's warpgroup MMAs): the split of a
// row's keys over blocks (grid.z), the partial results a split leaves for
// the merge kernel, and the cp.async / bf16 helpers.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace moelink::detail::attention::decode {

constexpr int kKeysPerStage = 64;  // keys a pipeline stage holds; splits are whole stages
constexpr int kRope = 64;          // rotary dims of a cache row (after the latent ones)
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (a shared-window address), bypassing L1; zeros
// when !valid (src unread).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint16_t to_bf16_bits(float x) {
  const __nv_bfloat16 v = __float2bfloat16_rn(x);
  return *reinterpret_cast<const uint16_t*>(&v);
}

// The keys [begin, end) of split `split` of `splits` for a row of `keys`
// keys: whole stages, the last split shorter (or empty).
struct KeyRange {
  int64_t begin, end;
};
__device__ __forceinline__ KeyRange split_keys(int64_t keys, int split, int splits) {
  const int64_t per = ((keys + splits - 1) / splits + kKeysPerStage - 1) / kKeysPerStage * kKeysPerStage;
  const int64_t begin = min(keys, per * split);
  return {begin, min(keys, begin + per)};
}

// Partial results of a split (splits > 1): outputs normalized by their own
// sum, and log2 of that sum plus the max (-inf: no keys).
struct Partials {
  float* out;  // [splits, Nd, heads, R]
  float* lse;  // [splits, Nd, heads]
};
__host__ __device__ inline Partials partials_of(void* ws, int splits, int64_t Nd, int heads, int R) {
  float* out = static_cast<float*>(ws);
  return {out, out + static_cast<size_t>(splits) * Nd * heads * R};
}

// A split without keys (a short row among long ones, or a block table
// longer than the row): its log-sum-exp is -inf for `count` heads from h0
// (of `heads`), which is all the merge reads of it; the caller returns
// before loading its queries.
__device__ __forceinline__ void mark_empty_split(const Partials& part, int64_t Nd, int split, int64_t r, int h0,
                                                 int count, int heads, int tid) {
  if (tid < count && h0 + tid < heads) part.lse[(static_cast<int64_t>(split) * Nd + r) * heads + h0 + tid] = -INFINITY;
}

// A thread's scores in `Tiles` n8 accumulator tiles of the MMAs' layout
// (element e of tile j: its row (e >> 1) of two, 8 rows apart; key key0 +
// 8 j + (e & 1), key0 holding the thread's first column) scaled into log2
// units with keys at or past their row's end[] masked; returns the maxima
// of the two rows over the thread's quad (the 4 lanes that hold a row's
// tile).
template <int Tiles>
__device__ __forceinline__ void scale_mask_max(float* sc, int64_t key0, const int64_t (&end)[2], float scale,
                                               float (&row_max)[2]) {
  row_max[0] = row_max[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < Tiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool in = key0 + j * 8 + (e & 1) < end[e >> 1];
      sc[4 * j + e] = in ? sc[4 * j + e] * scale : -INFINITY;
      row_max[e >> 1] = fmaxf(row_max[e >> 1], sc[4 * j + e]);
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
  }
}

// A decode row the plan skips (request < 0): heads [h0, h0 + count) of
// out_latent [heads, Nd, R] get zeros, by a block's `threads` threads. Only
// when its keys are not split: the merge kernel writes them otherwise.
__device__ __forceinline__ void zero_skipped_row(uint16_t* out_latent, int64_t Nd, int64_t r, int h0, int count,
                                                 int heads, int R, int tid, int threads) {
  for (int i = tid; i < count * R; i += threads) {
    const int h = h0 + i / R;
    if (h < heads) out_latent[(static_cast<int64_t>(h) * Nd + r) * R + i % R] = 0;
  }
}

}  // namespace moelink::detail::attention::decode
