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

// Pair i of `dims` rotary values (of Dr / 2): the indices of its two
// values, pairs (2i, 2i + 1) when interleaved, else (i, i + dims / 2).
MOELINK_HD void rope_pair(int i, int dims, bool interleaved, int* a, int* b) {
  *a = interleaved ? 2 * i : i;
  *b = interleaved ? 2 * i + 1 : i + dims / 2;
}

// Rotates pair i's values (x, y) by the angle pos * inv_freq[i]; cos and
// sin carry the attention factor.
MOELINK_HD void rope_rotate_pair(float* x, float* y, int i, int32_t pos, const float* inv_freq,
                                 float attention_factor) {
  const float angle = static_cast<float>(pos) * inv_freq[i];
  const float c = cosf(angle) * attention_factor, s = sinf(angle) * attention_factor;
  const float x0 = *x, y0 = *y;
  *x = x0 * c - y0 * s;
  *y = y0 * c + x0 * s;
}

// Rotates one token's Dr rotary values in place by position `pos`, pair by
// pair (rope_pair, rope_rotate_pair). The host loops and the kernels share
// it; the query's kernel rotates the pairs on threads of their own.
MOELINK_HD void rope_rotate(float* v, int dims, int32_t pos, const float* inv_freq,
                            float attention_factor, bool interleaved) {
  for (int i = 0; i < dims / 2; ++i) {
    int a, b;
    rope_pair(i, dims, interleaved, &a, &b);
    rope_rotate_pair(&v[a], &v[b], i, pos, inv_freq, attention_factor);
  }
}

}  // namespace moelink::detail::attention
