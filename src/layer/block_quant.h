// Weights given in bf16 or fp32 become DeepSeek-V3's fp8 format on the host:
// one fp32 scale per 128 x 128 block, scale = max(amax, 1e-12) / 448 (the
// checkpoint's weight_scale_inv), q = e4m3(w / scale).
#pragma once

#include <cstdint>

namespace moelink::detail::layer {

// w [rows, cols] (rows, cols multiples of 128) -> q [rows, cols] fp8 e4m3,
// scale [rows/128, cols/128].
void quantize_weight_blocks(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale);

}  // namespace moelink::detail::layer
