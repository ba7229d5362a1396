// The kernel behind rms_norm.h.
#include "nvlink/bf16_bits.cuh"
#include "nvlink/cuda_check.h"
#include "nvlink/device_utils.cuh"  // load_16, Vec8
#include "nvlink/reductions.cuh"
#include "nvlink/rms_norm.h"

namespace moelink::detail {

namespace {

__global__ void residual_rms_norm_kernel(const uint16_t* in, int64_t in_stride, const uint16_t* add,
                                         int64_t add_stride, uint16_t* sum_out, int64_t sum_stride, uint16_t* normed,
                                         int64_t normed_stride, int64_t cols, const float* weight, float eps,
                                         const int32_t* rows) {
  const int64_t r = blockIdx.x;
  if (r >= *rows) return;
  const uint16_t* row = in + r * in_stride;
  uint16_t* sum_row = sum_out + r * sum_stride;
  // With a residual, the rounded sums are read back from sum_out (this
  // thread's own columns): in may alias it.
  const uint16_t* s_row = add != nullptr ? sum_row : row;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float s = bf16_bits_to_f32(row[c]);
    if (add != nullptr) {
      sum_row[c] = f32_to_bf16_bits(s + bf16_bits_to_f32(add[r * add_stride + c]));
      s = bf16_bits_to_f32(sum_row[c]);
    }
    ss += s * s;
  }
  if (weight == nullptr) return;
  __shared__ float shared[32];
  ss = block_reduce(ss, Sum{}, shared);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
  uint16_t* out = normed + r * normed_stride;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[c] = f32_to_bf16_bits(bf16_bits_to_f32(s_row[c]) * inv * weight[c]);
}


// The same rule with the row held in registers: each thread loads its
// columns as 16-byte vectors of 8 bf16 (at most kVecs of them, Vec8) before
// storing anything, so a row costs two or three rounds of memory latency
// instead of one per 256 columns (the scalar kernel's loads cannot pass its
// own stores: `in` may alias `sum_out`). For cols a multiple of 8, at most
// 8 x kVecs x blockDim, every row and pointer 16-byte aligned.
constexpr int kNormThreads = 256, kNormVecs = 4;
using Bf16x8 = Vec8<__nv_bfloat16>;

template <int kVecs>
__global__ void residual_rms_norm_vec_kernel(const uint16_t* in, int64_t in_stride, const uint16_t* add,
                                             int64_t add_stride, uint16_t* sum_out, int64_t sum_stride,
                                             uint16_t* normed, int64_t normed_stride, int64_t cols,
                                             const float* weight, float eps, const int32_t* rows) {
  const int64_t r = blockIdx.x;
  if (r >= *rows) return;
  const int64_t vecs = cols / 8;
  uint4 in_raw[kVecs], add_raw[kVecs];  // every load issued before any is used
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t j = threadIdx.x + int64_t{k} * blockDim.x;
    if (j >= vecs) continue;
    in_raw[k] = load_16(in + r * in_stride + 8 * j);
    if (add != nullptr) add_raw[k] = load_16(add + r * add_stride + 8 * j);
  }
  float v[kVecs][8];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t j = threadIdx.x + int64_t{k} * blockDim.x;
    if (j >= vecs) continue;
    Bf16x8::from_raw(&in_raw[k], v[k]);
    if (add != nullptr) {
      float x[8];
      Bf16x8::from_raw(&add_raw[k], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[k][i] = bf16_bits_to_f32(f32_to_bf16_bits(v[k][i] + x[i]));  // as stored
      Bf16x8::store(sum_out + r * sum_stride + 8 * j, v[k]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
  }
  if (weight == nullptr) return;
  __shared__ float shared[32];
  ss = block_reduce(ss, Sum{}, shared);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t j = threadIdx.x + int64_t{k} * blockDim.x;
    if (j >= vecs) continue;
    float w[8];
    Vec8<float>::load(weight + 8 * j, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] *= v[k][i] * inv;
    Bf16x8::store(normed + r * normed_stride + 8 * j, w);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void launch_residual_rms_norm(const uint16_t* in, int64_t in_stride, const uint16_t* add, int64_t add_stride,
                              uint16_t* sum_out, int64_t sum_stride, uint16_t* normed, int64_t normed_stride,
                              int64_t cols, const float* weight, float eps, const int32_t* rows, int64_t max_rows,
                              cudaStream_t stream) {
  if (max_rows == 0) return;
  const bool vec = cols % 8 == 0 && cols <= int64_t{8} * kNormVecs * kNormThreads && in_stride % 8 == 0 &&
                   aligned16(in) && (add == nullptr || (add_stride % 8 == 0 && aligned16(add))) &&
                   (add == nullptr || (sum_stride % 8 == 0 && aligned16(sum_out))) &&
                   (weight == nullptr || (normed_stride % 8 == 0 && aligned16(normed) && aligned16(weight)));
  if (vec) {
    residual_rms_norm_vec_kernel<kNormVecs><<<static_cast<unsigned>(max_rows), kNormThreads, 0, stream>>>(
        in, in_stride, add, add_stride, sum_out, sum_stride, normed, normed_stride, cols, weight, eps, rows);
    MOELINK_CUDA_CHECK(cudaGetLastError());
    return;
  }
  residual_rms_norm_kernel<<<static_cast<unsigned>(max_rows), 256, 0, stream>>>(
      in, in_stride, add, add_stride, sum_out, sum_stride, normed, normed_stride, cols, weight, eps, rows);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail
