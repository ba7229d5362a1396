// RMSNorm of bf16 rows with an optional residual add, on the host: the
// attention's input / latent norms and the model's residual stream use this
// one loop (src/nvlink/rms_norm.h is the device's).
//
//   s = in[r] (+ add[r], rounded to bf16 and stored to sum_out[r] when add is
//       given: the residual stream is bf16, as in HF's bf16 model)
//   normed[r] = bf16(s / sqrt(mean(s^2) + eps) * weight)   (weight given)
//
// sum_out may alias in (the model adds in place).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/float_convert.h"

namespace moelink::detail {

inline void residual_rms_norm_rows(const uint16_t* in, int64_t in_stride, const uint16_t* add, int64_t add_stride,
                                   uint16_t* sum_out, int64_t sum_stride, uint16_t* normed, int64_t normed_stride,
                                   int64_t cols, const float* weight, float eps, int64_t rows) {
  std::vector<float> v(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      float s = bf16_to_f32(in[r * in_stride + c]);
      if (add != nullptr) {
        const uint16_t rounded = f32_to_bf16(s + bf16_to_f32(add[r * add_stride + c]));
        sum_out[r * sum_stride + c] = rounded;
        s = bf16_to_f32(rounded);
      }
      v[c] = s;
      ss += s * s;
    }
    if (weight == nullptr) continue;
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) normed[r * normed_stride + c] = f32_to_bf16(v[c] * inv * weight[c]);
  }
}

}  // namespace moelink::detail
