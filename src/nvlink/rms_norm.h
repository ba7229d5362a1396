// RMSNorm of bf16 rows with an optional residual add on the GPU, one block a
// row (src/core/rms_norm.h gives the rule and is the host's loop): the
// attention's input / latent norms and the model's residual stream. Rows r
// < rows[0] (read on the device) of at most max_rows; add, sum_out, normed
// and weight may be null as there.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moelink::detail {

void launch_residual_rms_norm(const uint16_t* in, int64_t in_stride, const uint16_t* add, int64_t add_stride,
                              uint16_t* sum_out, int64_t sum_stride, uint16_t* normed, int64_t normed_stride,
                              int64_t cols, const float* weight, float eps, const int32_t* rows, int64_t max_rows,
                              cudaStream_t stream);

}  // namespace moelink::detail
