#include "layer/layer_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "experts/expert_reference.h"
#include "ref_dtype.h"

namespace moelink_test {

using moelink::DType;
using moelink::MoEModelConfig;
using moelink::Tensor;

namespace {

// One expert MLP on fp8 x (1x128 scales): GEMM1 rounded to bf16, SiLU-and-mul,
// requantized, GEMM2 rounded to bf16.
std::vector<double> ref_mlp(const uint8_t* xq, const float* xs, const uint8_t* w13, const float* w13s,
                            const uint8_t* w2, const float* w2s, int64_t H, int64_t I) {
  const RefRow gu = ref_gemm_row(xq, xs, w13, w13s, 2 * I, H);
  std::vector<double> v(I);
  for (int64_t i = 0; i < I; ++i) v[i] = ref_silu_mul(round_to_bf16(gu.y[i]), round_to_bf16(gu.y[I + i]));
  std::vector<uint8_t> aq(I);
  std::vector<float> as(I / kGroup);
  ref_quantize_row(v.data(), I, aq.data(), as.data());
  std::vector<double> y = ref_gemm_row(aq.data(), as.data(), w2, w2s, H, I).y;
  for (double& e : y) e = round_to_bf16(e);
  return y;
}

}  // namespace

LayerWeights random_layer_weights(const MoEModelConfig& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  LayerWeights w;
  std::normal_distribution<double> nd(0.0, 1.0);
  // Logits of a few units: x ~ N(0, 1), gate ~ N(0, 1/sqrt(H)).
  w.gate.resize(E * H);
  for (auto& g : w.gate) g = bf16_bits_exact(round_to_bf16(nd(rng) / std::sqrt(static_cast<double>(H))));
  if (m.score_correction_bias) {
    w.gate_bias.resize(E);
    for (auto& b : w.gate_bias) b = static_cast<float>(0.05 * nd(rng));
  }
  auto block_weights = [&](int64_t count, int64_t n, int64_t k, std::vector<uint8_t>& q,
                           std::vector<float>& s) {
    q.resize(count * n * k);
    s.resize(count * (n / kGroup) * (k / kGroup));
    for (int64_t e = 0; e < count; ++e)
      random_block_weight(rng, n, k, &q[e * n * k], &s[e * (n / kGroup) * (k / kGroup)]);
  };
  block_weights(E, 2 * I, H, w.w13, w.w13_scale);
  block_weights(E, H, I, w.w2, w.w2_scale);
  if (Is > 0) {
    block_weights(1, 2 * Is, H, w.shared_w13, w.shared_w13_scale);
    block_weights(1, H, Is, w.shared_w2, w.shared_w2_scale);
  }
  return w;
}

moelink::MoEWeights LayerWeights::view(const MoEModelConfig& m, int rank, int L) {
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  const int64_t e0 = static_cast<int64_t>(rank) * L;
  moelink::MoEWeights v;
  v.gate = Tensor::contiguous(gate.data(), DType::kBFloat16, {E, H});
  if (!gate_bias.empty()) v.gate_bias = Tensor::contiguous(gate_bias.data(), DType::kFloat32, {E});
  v.w13 = Tensor::contiguous(&w13[e0 * 2 * I * H], DType::kFloat8E4M3, {L, 2 * I, H});
  v.w13_scale = Tensor::contiguous(&w13_scale[e0 * (2 * I / kGroup) * (H / kGroup)], DType::kFloat32,
                                   {L, 2 * I / kGroup, H / kGroup});
  v.w2 = Tensor::contiguous(&w2[e0 * H * I], DType::kFloat8E4M3, {L, H, I});
  v.w2_scale = Tensor::contiguous(&w2_scale[e0 * (H / kGroup) * (I / kGroup)], DType::kFloat32,
                                  {L, H / kGroup, I / kGroup});
  if (Is > 0) {
    v.shared_w13 = Tensor::contiguous(shared_w13.data(), DType::kFloat8E4M3, {2 * Is, H});
    v.shared_w13_scale = Tensor::contiguous(shared_w13_scale.data(), DType::kFloat32,
                                            {2 * Is / kGroup, H / kGroup});
    v.shared_w2 = Tensor::contiguous(shared_w2.data(), DType::kFloat8E4M3, {H, Is});
    v.shared_w2_scale = Tensor::contiguous(shared_w2_scale.data(), DType::kFloat32,
                                           {H / kGroup, Is / kGroup});
  }
  return v;
}

RefRoute ref_route(const MoEModelConfig& m, const LayerWeights& w, const uint16_t* x) {
  const int E = m.n_routed_experts, H = m.hidden_size, k = m.num_experts_per_tok;
  std::vector<double> z(E), s(E), c(E);
  for (int e = 0; e < E; ++e) {
    double acc = 0;
    for (int h = 0; h < H; ++h) acc += bf16_to_double(x[h]) * bf16_to_double(w.gate[e * H + h]);
    z[e] = acc;
  }
  if (m.scoring == moelink::ScoringFunction::kSigmoid) {
    for (int e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-z[e]));
  } else {
    const double mx = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (s[e] = std::exp(z[e] - mx));
    for (double& v : s) v /= sum;
  }
  for (int e = 0; e < E; ++e) c[e] = s[e] + (w.gate_bias.empty() ? 0.0 : w.gate_bias[e]);
  RefRoute r;
  r.margin = std::numeric_limits<double>::infinity();
  const double kInf = std::numeric_limits<double>::infinity();
  if (m.n_group > 1) {
    const int per = E / m.n_group;
    std::vector<double> gs(m.n_group);
    for (int g = 0; g < m.n_group; ++g) {
      std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<double>());
      gs[g] = v[0] + v[1];
    }
    std::vector<int> order(m.n_group);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    if (m.topk_group < m.n_group)
      r.margin = std::min(r.margin, gs[order[m.topk_group - 1]] - gs[order[m.topk_group]]);
    std::vector<bool> keep(m.n_group, false);
    for (int i = 0; i < m.topk_group; ++i) keep[order[i]] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) c[e] = -kInf;
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return c[a] > c[b]; });
  if (k < E && c[order[k]] > -kInf) r.margin = std::min(r.margin, c[order[k - 1]] - c[order[k]]);
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    r.experts.push_back(order[i]);
    r.weights.push_back(s[order[i]]);
    sum += s[order[i]];
  }
  for (double& v : r.weights)
    v = (m.norm_topk_prob ? v / (sum + 1e-20) : v) * m.routed_scaling_factor;
  return r;
}

std::vector<double> ref_layer_row(const MoEModelConfig& m, const LayerWeights& w, const uint16_t* x,
                                  const RefRoute& route) {
  const int64_t H = m.hidden_size, I = m.moe_intermediate_size, Is = m.shared_intermediate_size();
  std::vector<double> xd(H);
  for (int64_t h = 0; h < H; ++h) xd[h] = bf16_to_double(x[h]);
  std::vector<uint8_t> xq(H);
  std::vector<float> xs(H / kGroup);
  ref_quantize_row(xd.data(), H, xq.data(), xs.data());
  std::vector<double> out(H, 0.0);
  for (size_t i = 0; i < route.experts.size(); ++i) {
    const int64_t e = route.experts[i];
    const std::vector<double> y =
        ref_mlp(xq.data(), xs.data(), &w.w13[e * 2 * I * H], &w.w13_scale[e * (2 * I / kGroup) * (H / kGroup)],
                &w.w2[e * H * I], &w.w2_scale[e * (H / kGroup) * (I / kGroup)], H, I);
    for (int64_t h = 0; h < H; ++h) out[h] += route.weights[i] * y[h];
  }
  if (Is > 0) {
    const std::vector<double> y = ref_mlp(xq.data(), xs.data(), w.shared_w13.data(),
                                          w.shared_w13_scale.data(), w.shared_w2.data(),
                                          w.shared_w2_scale.data(), H, Is);
    for (int64_t h = 0; h < H; ++h) out[h] += y[h];
  }
  return out;
}

}  // namespace moelink_test
