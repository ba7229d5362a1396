// The MoE layer's own small kernels (the GEMMs are cuBLAS's and Experts'):
// the router after the gate GEMM, the micro-batch split of m, and copies of
// the first m rows (the CUDA-graph staging buffers). All read m on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "layer/layer_device.h"
#include "layer/router.h"

namespace moelink::detail::layer {

// router.h's routing for rows t < min(bound_m[0], rows) (a warp per token).
void launch_router(const float* logits, int64_t logits_stride, const float* bias,
                   const RouterParams& p, const int32_t* bound_m, int64_t rows, int32_t* indices,
                   int64_t indices_stride, float* weights, int64_t weights_stride,
                   cudaStream_t stream);

// m = clamp(bound_m[0], 0, rows): m0 = min(m, half), m1 = m - m0.
void launch_split_bound(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0,
                        int32_t* m1, cudaStream_t stream);

// Rows r < m = clamp(bound_m[0], 0, rows) of `src` to `dst` (row_bytes
// each, 16-byte aligned rows). When bound_m_dst is non-null, m goes there
// too, and a bound_m outside [0, rows] is recorded in `error`.
void launch_copy_rows(void* dst, int64_t dst_stride_bytes, const void* src,
                      int64_t src_stride_bytes, int64_t row_bytes, const int32_t* bound_m,
                      int64_t rows, int32_t* bound_m_dst, LayerErrorRecord* error,
                      cudaStream_t stream);

// dst [rows, cols] fp32 (packed) = src [rows, cols] bf16 (row stride in elements).
void launch_bf16_to_f32(float* dst, const uint16_t* src, int64_t src_stride, int64_t rows,
                        int64_t cols, cudaStream_t stream);

}  // namespace moelink::detail::layer
