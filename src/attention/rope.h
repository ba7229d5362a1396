// Rotary position embedding of MLA's Dr rotary dims, with DeepSeek's YaRN
// scaling, as Hugging Face computes it (_compute_yarn_parameters and
// DeepseekV3RotaryEmbedding): per pair i < Dr/2 a frequency blended between
// the original (extrapolation) and divided by `factor` (interpolation) over
// the dims whose wavelengths lie between beta_fast and beta_slow rotations
// in the original context; cos and sin scaled by the attention factor
// mscale(factor, mscale) / mscale(factor, mscale_all_dim). The angle of
// position p is p * inv_freq[i] in fp32, as HF does.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/layout.h"  // MOELINK_HD

namespace moelink {
struct MLAConfig;
}

namespace moelink::detail::attention {

// YaRN's magnitude correction: 0.1 * mscale * ln(scale) + 1 above scale 1.
inline double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

struct RopeParams {
  std::vector<float> inv_freq;  // [Dr / 2]
  float attention_factor = 1.0f;
};
RopeParams rope_params(const MLAConfig& c);

// Rotates one token's Dr rotary values in place by position `pos`:
// pairs (2i, 2i + 1) when interleaved, else (i, i + Dr/2), each by the
// angle pos * inv_freq[i]; cos and sin carry the attention factor. The host
// loops and the kernels share it.
MOELINK_HD void rope_rotate(float* v, int dims, int32_t pos, const float* inv_freq,
                            float attention_factor, bool interleaved) {
  const int half = dims / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = cosf(angle) * attention_factor, s = sinf(angle) * attention_factor;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float x = v[a], y = v[b];
    v[a] = x * c - y * s;
    v[b] = y * c + x * s;
  }
}

}  // namespace moelink::detail::attention
