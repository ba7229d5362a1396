#include "attention/rope.h"

#include <algorithm>

#include "moelink/attention.h"

namespace moelink::detail::attention {

namespace {

// The dim index (of Dr) at which `rotations` full turns fit in the original
// context.
double correction_dim(double rotations, int dims, double base, double context) {
  return dims * std::log(context / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}

}  // namespace

RopeParams rope_params(const MLAConfig& c) {
  const int dims = c.qk_rope_head_dim, half = dims / 2;
  const double base = c.rope_theta;
  RopeParams p;
  p.inv_freq.resize(half);
  // HF computes base ** (2i / dims) in fp32.
  std::vector<float> pos_freq(half);
  for (int i = 0; i < half; ++i)
    pos_freq[i] = std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dims));
  const RopeScaling& r = c.rope_scaling;
  if (r.type != "yarn") {
    for (int i = 0; i < half; ++i) p.inv_freq[i] = 1.0f / pos_freq[i];
    return p;
  }
  const double context = static_cast<double>(r.original_max_position_embeddings);
  double low = std::floor(correction_dim(r.beta_fast, dims, base, context));
  double high = std::ceil(correction_dim(r.beta_slow, dims, base, context));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dims - 1));
  if (low == high) high += 0.001;
  const float factor = static_cast<float>(r.factor);
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp(static_cast<float>((i - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;  // weight of the original frequency
    const float orig = 1.0f / pos_freq[i], interp = 1.0f / (factor * pos_freq[i]);
    p.inv_freq[i] = interp * (1.0f - extrapolation) + orig * extrapolation;
  }
  p.attention_factor = static_cast<float>(
      r.mscale != 0.0 && r.mscale_all_dim != 0.0
          ? yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
          : yarn_mscale(r.factor, 1.0));
  return p;
}

}  // namespace moelink::detail::attention
