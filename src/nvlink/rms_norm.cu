// The kernel behind rms_norm.h.
#include "nvlink/bf16_bits.cuh"
#include "nvlink/cuda_check.h"
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

}  // namespace

void launch_residual_rms_norm(const uint16_t* in, int64_t in_stride, const uint16_t* add, int64_t add_stride,
                              uint16_t* sum_out, int64_t sum_stride, uint16_t* normed, int64_t normed_stride,
                              int64_t cols, const float* weight, float eps, const int32_t* rows, int64_t max_rows,
                              cudaStream_t stream) {
  if (max_rows == 0) return;
  residual_rms_norm_kernel<<<static_cast<unsigned>(max_rows), 256, 0, stream>>>(
      in, in_stride, add, add_stride, sum_out, sum_stride, normed, normed_stride, cols, weight, eps, rows);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail
