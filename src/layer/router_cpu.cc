// The router (router.h) as plain loops, one token at a time.
#include <cmath>
#include <limits>
#include <vector>

#include "layer/router.h"

namespace moelink::detail::layer {

RouterParams router_params(const MoEModelConfig& m) {
  return RouterParams{m.n_routed_experts,    m.num_experts_per_tok,       m.n_group,
                      m.topk_group,          m.scoring == ScoringFunction::kSigmoid,
                      m.score_correction_bias, m.norm_topk_prob, m.routed_scaling_factor};
}

namespace {

// The index of the largest v[i] among `n` (the lowest index on ties).
int argmax(const float* v, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

}  // namespace

void route_cpu(const float* logits, int64_t logits_stride, const float* bias, const RouterParams& p,
               int64_t rows, int32_t* indices, int64_t indices_stride, float* weights,
               int64_t weights_stride) {
  const int E = p.num_experts;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> s(E), c(E), group_score(p.n_group);
  for (int64_t t = 0; t < rows; ++t) {
    const float* z = logits + t * logits_stride;
    if (p.sigmoid) {
      for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-z[e]));
    } else {
      float mx = z[0];
      for (int e = 1; e < E; ++e) mx = std::fmax(mx, z[e]);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) sum += (s[e] = std::exp(z[e] - mx));
      for (int e = 0; e < E; ++e) s[e] /= sum;
    }
    for (int e = 0; e < E; ++e) c[e] = p.has_bias ? s[e] + bias[e] : s[e];
    if (p.n_group > 1) {
      const int per = E / p.n_group;
      for (int g = 0; g < p.n_group; ++g) {
        float top1 = kNegInf, top2 = kNegInf;
        for (int e = g * per; e < (g + 1) * per; ++e) {
          if (c[e] > top1) {
            top2 = top1;
            top1 = c[e];
          } else if (c[e] > top2) {
            top2 = c[e];
          }
        }
        group_score[g] = top1 + top2;
      }
      std::vector<bool> keep(p.n_group, false);
      for (int r = 0; r < p.topk_group; ++r) {
        const int g = argmax(group_score.data(), p.n_group);
        keep[g] = true;
        group_score[g] = kNegInf;
      }
      for (int e = 0; e < E; ++e)
        if (!keep[e / per]) c[e] = kNegInf;
    }
    int32_t* idx = indices + t * indices_stride;
    float* w = weights + t * weights_stride;
    float sum = 0.0f;
    for (int i = 0; i < p.top_k; ++i) {
      const int e = argmax(c.data(), E);
      idx[i] = e;
      w[i] = s[e];
      sum += s[e];
      c[e] = kNegInf;
    }
    const float norm = p.norm_topk_prob ? 1.0f / (sum + 1e-20f) : 1.0f;
    for (int i = 0; i < p.top_k; ++i) w[i] = w[i] * norm * p.routed_scaling_factor;
  }
}

}  // namespace moelink::detail::layer
