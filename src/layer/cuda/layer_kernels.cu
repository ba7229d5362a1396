// The router as a warp per token, the micro-batch split of m and the row
// copies (layer_kernels.h).
#include <algorithm>
#include <cfloat>

#include "layer/cuda/layer_kernels.h"
#include "nvlink/cuda_check.h"
#include "nvlink/reductions.cuh"

namespace moelink::detail::layer {
namespace {

constexpr int kRouterWarps = 4;  // tokens per block

// (value, expert) of the better candidate: larger value, lower expert on ties.
struct Candidate {
  float value;
  int expert;
};
__device__ inline Candidate better(Candidate a, Candidate b) {
  return (b.value > a.value || (b.value == a.value && b.expert < a.expert)) ? b : a;
}
__device__ inline Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.value, offset),
                __shfl_xor_sync(0xffffffffu, c.expert, offset)};
    c = better(c, o);
  }
  return c;
}
// Lane l holds experts l, l + 32, ..., kSlots of them (E <= 32 kSlots): the
// loops below are unrolled over the slots, so kSlots is the smallest power of
// two that holds E (a warp working through 32 slots for DeepSeek-V3's 256
// experts took 21 us per token on an H200; the kernel is latency-bound).
// The choice scores c also go to shared memory for the per-group top-2
// (lane g scans group g).
template <int kSlots>
__global__ void __launch_bounds__(kRouterWarps * 32)
    router_kernel(const float* logits, int64_t logits_stride, const float* bias, RouterParams p,
                  const int32_t* bound_m, int64_t rows, int32_t* indices, int64_t indices_stride,
                  float* weights, int64_t weights_stride) {
  extern __shared__ float smem[];  // [kRouterWarps][E]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  const int64_t m = min(static_cast<int64_t>(max(*bound_m, 0)), rows);
  if (t >= m) return;  // the whole warp
  const int E = p.num_experts;
  float* c_smem = smem + warp * E;
  const float* z = logits + t * logits_stride;
  float s[kSlots], c[kSlots];
  float zmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int e = lane + 32 * j;
    s[j] = e < E ? z[e] : -INFINITY;
    zmax = fmaxf(zmax, s[j]);
  }
  if (p.sigmoid) {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) s[j] = 1.0f / (1.0f + expf(-s[j]));
  } else {
    zmax = warp_max(zmax);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) sum += (s[j] = lane + 32 * j < E ? expf(s[j] - zmax) : 0.0f);
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kSlots; ++j) s[j] /= sum;
  }
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int e = lane + 32 * j;
    c[j] = e < E ? (p.has_bias ? s[j] + bias[e] : s[j]) : -INFINITY;
    if (e < E) c_smem[e] = c[j];
  }
  if (p.n_group > 1) {
    __syncwarp();
    const int per = E / p.n_group;
    float group_score = -INFINITY;
    if (lane < p.n_group) {
      float top1 = -INFINITY, top2 = -INFINITY;
      for (int e = lane * per; e < (lane + 1) * per; ++e) {
        const float v = c_smem[e];
        if (v > top1) {
          top2 = top1;
          top1 = v;
        } else if (v > top2) {
          top2 = v;
        }
      }
      group_score = top1 + top2;
    }
    unsigned keep = 0;
    for (int r = 0; r < p.topk_group; ++r) {
      const Candidate best = warp_best({group_score, lane});
      keep |= 1u << best.expert;
      if (lane == best.expert) group_score = -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !((keep >> (e / per)) & 1u)) c[j] = -INFINITY;
    }
  }
  int32_t* idx = indices + t * indices_stride;
  float* w = weights + t * weights_stride;
  float picked[16];
  float sum = 0.0f;
  for (int i = 0; i < p.top_k; ++i) {
    Candidate mine{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int j = 0; j < kSlots; ++j) mine = better(mine, Candidate{c[j], lane + 32 * j});
    const Candidate best = warp_best(mine);
    const int owner = best.expert % 32, slot = best.expert / 32;
    float score = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j)
      if (lane == owner && j == slot) {
        score = s[j];
        c[j] = -INFINITY;
      }
    score = __shfl_sync(0xffffffffu, score, owner);
    picked[i] = score;
    sum += score;
    if (lane == 0) idx[i] = best.expert;
  }
  if (lane == 0) {
    const float norm = p.norm_topk_prob ? 1.0f / (sum + 1e-20f) : 1.0f;
    for (int i = 0; i < p.top_k; ++i) w[i] = picked[i] * norm * p.routed_scaling_factor;
  }
}

__global__ void split_bound_kernel(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0,
                                   int32_t* m1) {
  const int64_t m = min(static_cast<int64_t>(max(*bound_m, 0)), rows);
  const int64_t first = min(m, half);
  *m0 = static_cast<int32_t>(first);
  *m1 = static_cast<int32_t>(m - first);
}

__global__ void copy_rows_kernel(char* dst, int64_t dst_stride, const char* src, int64_t src_stride,
                                 int64_t row_bytes, const int32_t* bound_m, int64_t rows,
                                 int32_t* bound_m_dst, LayerErrorRecord* error) {
  const int32_t asked = *bound_m;
  const int64_t m = min(static_cast<int64_t>(max(asked, 0)), rows);
  if (bound_m_dst != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *bound_m_dst = static_cast<int32_t>(m);
    if (m != asked && atomicCAS(&error->code, 0, 1) == 0) {
      error->value = asked;
      error->limit = rows;
    }
  }
  const int64_t vecs = row_bytes / 16;
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(src + r * src_stride);
    uint4* d = reinterpret_cast<uint4*>(dst + r * dst_stride);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) d[v] = s[v];
  }
}

__global__ void bf16_to_f32_kernel(float* dst, const uint16_t* src, int64_t src_stride,
                                   int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dst[r * cols + c] = __uint_as_float(static_cast<uint32_t>(src[r * src_stride + c]) << 16);
}

}  // namespace

void launch_bf16_to_f32(float* dst, const uint16_t* src, int64_t src_stride, int64_t rows,
                        int64_t cols, cudaStream_t stream) {
  if (rows <= 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(rows, 4096));
  bf16_to_f32_kernel<<<blocks, 256, 0, stream>>>(dst, src, src_stride, rows, cols);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_router(const float* logits, int64_t logits_stride, const float* bias,
                   const RouterParams& p, const int32_t* bound_m, int64_t rows, int32_t* indices,
                   int64_t indices_stride, float* weights, int64_t weights_stride,
                   cudaStream_t stream) {
  if (rows <= 0) return;
  const int blocks = static_cast<int>((rows + kRouterWarps - 1) / kRouterWarps);
  const size_t smem = static_cast<size_t>(kRouterWarps) * p.num_experts * sizeof(float);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, kRouterWarps * 32, smem, stream>>>(logits, logits_stride, bias, p, bound_m, rows,
                                                        indices, indices_stride, weights, weights_stride);
  };
  const int slots = (p.num_experts + 31) / 32;  // RouterParams: E <= 1024 (checked on the host)
  if (slots <= 1) launch(router_kernel<1>);
  else if (slots <= 2) launch(router_kernel<2>);
  else if (slots <= 4) launch(router_kernel<4>);
  else if (slots <= 8) launch(router_kernel<8>);
  else if (slots <= 16) launch(router_kernel<16>);
  else launch(router_kernel<32>);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_split_bound(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0,
                        int32_t* m1, cudaStream_t stream) {
  split_bound_kernel<<<1, 1, 0, stream>>>(bound_m, rows, half, m0, m1);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_copy_rows(void* dst, int64_t dst_stride_bytes, const void* src,
                      int64_t src_stride_bytes, int64_t row_bytes, const int32_t* bound_m,
                      int64_t rows, int32_t* bound_m_dst, LayerErrorRecord* error,
                      cudaStream_t stream) {
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 1024)));
  copy_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<char*>(dst), dst_stride_bytes,
                                               static_cast<const char*>(src), src_stride_bytes,
                                               row_bytes, bound_m, rows, bound_m_dst, error);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::layer
