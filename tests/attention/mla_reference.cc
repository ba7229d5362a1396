#include "attention/mla_reference.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "experts/expert_reference.h"  // random_block_weight, ref_quantize_row
#include "ref_dtype.h"

namespace moelink_test {

using moelink::DType;
using moelink::MLAConfig;
using moelink::Tensor;

namespace {

MLATestWeights::Projection random_projection(std::mt19937_64& rng, int64_t rows, int64_t cols) {
  MLATestWeights::Projection p;
  p.rows = rows;
  p.cols = cols;
  const int64_t padded = (rows + 127) / 128 * 128;
  std::vector<uint8_t> q(padded * cols);
  std::vector<float> s((padded / 128) * (cols / 128));
  random_block_weight(rng, padded, cols, q.data(), s.data());
  p.q.assign(q.begin(), q.begin() + rows * cols);
  p.scale = s;
  p.w.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      p.w[r * cols + c] = fp8_e4m3_to_double(p.q[r * cols + c]) * s[(r / 128) * (cols / 128) + c / 128];
  return p;
}

std::vector<float> random_norm(std::mt19937_64& rng, int64_t n) {
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(round_to_bf16(u(rng)));
  return v;
}

// v through 1x128 fp8 quantization and back.
std::vector<double> fp8_roundtrip(const std::vector<double>& v) {
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(v.size() / 128);
  ref_quantize_row(v.data(), static_cast<int64_t>(v.size()), q.data(), s.data());
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = fp8_e4m3_to_double(q[i]) * s[i / 128];
  return out;
}

// y = x . W^T (rows 0..rows-1 of W), x first quantized when asked.
std::vector<double> project(const MLATestWeights::Projection& p, std::vector<double> x, bool quantize) {
  if (quantize) x = fp8_roundtrip(x);
  std::vector<double> y(p.rows, 0.0);
  for (int64_t r = 0; r < p.rows; ++r) {
    double acc = 0;
    for (int64_t c = 0; c < p.cols; ++c) acc += p.w[r * p.cols + c] * x[c];
    y[r] = acc;
  }
  return y;
}

// HF's DeepseekV3RMSNorm: normalized in fp32, cast to bf16, times the
// weight (the module rounds once, after the weight; both within bf16).
std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = round_to_bf16(x[i] * inv * w[i]);
  return y;
}

// HF's _compute_yarn_parameters and rotary embedding, in double.
struct Rope {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
};

double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

Rope make_rope(const MLAConfig& c) {
  const int dim = c.qk_rope_head_dim;
  Rope r;
  r.inv_freq.resize(dim / 2);
  for (int i = 0; i < dim / 2; ++i) r.inv_freq[i] = 1.0 / std::pow(c.rope_theta, 2.0 * i / dim);
  if (c.rope_scaling.type != "yarn") return r;
  const auto& s = c.rope_scaling;
  auto corr = [&](double rot) {
    return dim * std::log(s.original_max_position_embeddings / (rot * 2 * M_PI)) / (2 * std::log(c.rope_theta));
  };
  const double low = std::max(std::floor(corr(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(s.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < dim / 2; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extra = r.inv_freq[i], inter = r.inv_freq[i] / s.factor;
    r.inv_freq[i] = inter * ramp + extra * (1.0 - ramp);
  }
  r.attention_factor = (s.mscale != 0 && s.mscale_all_dim != 0)
                           ? yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
                           : yarn_get_mscale(s.factor, 1.0);
  return r;
}

// HF's rotary embedding at position `pos`. HF's
// apply_rotary_pos_emb_interleave first permutes the dims to (evens, odds)
// and rotates i with i + Dr/2; rotating each pair (2i, 2i + 1) in place is
// the same rotation in DeepSeek's own order (the one its cache stores), and
// dot products do not see the order. Plain RoPE pairs i with i + Dr/2.
std::vector<double> rope(const Rope& r, const std::vector<double>& v, int64_t pos, bool interleave) {
  const size_t half = v.size() / 2;
  std::vector<double> y(v);
  for (size_t i = 0; i < half; ++i) {
    const size_t a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + half;
    // HF's angle: fp32 inv_freq times the fp32 position.
    const double angle = static_cast<double>(static_cast<float>(pos) * static_cast<float>(r.inv_freq[i]));
    const double c = std::cos(angle) * r.attention_factor, s = std::sin(angle) * r.attention_factor;
    y[a] = v[a] * c - v[b] * s;
    y[b] = v[b] * c + v[a] * s;
  }
  return y;
}

std::vector<double> rounded_bf16(std::vector<double> v) {
  for (double& x : v) x = round_to_bf16(x);
  return v;
}

std::vector<double> row_of(const uint16_t* x, int64_t D) {
  std::vector<double> v(D);
  for (int64_t i = 0; i < D; ++i) v[i] = bf16_to_double(x[i]);
  return v;
}

}  // namespace

MLATestWeights random_mla_weights(const MLAConfig& c, uint64_t seed, bool input_norm) {
  std::mt19937_64 rng(seed);
  MLATestWeights w;
  w.config = c;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, Rq = c.q_lora_rank, R = c.kv_lora_rank,
                Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim;
  if (input_norm) w.input_layernorm = random_norm(rng, D);
  w.q_a_layernorm = random_norm(rng, Rq);
  w.kv_a_layernorm = random_norm(rng, R);
  w.q_a = random_projection(rng, Rq, D);
  w.kv_a = random_projection(rng, R + Dr, D);
  w.q_b = random_projection(rng, H * (Dn + Dr), Rq);
  w.kv_b = random_projection(rng, H * (Dn + Dv), R);
  w.o = random_projection(rng, D, H * Dv);
  return w;
}

moelink::MLAWeights MLATestWeights::view() {
  auto proj = [](Projection& p, Tensor& t, Tensor& s) {
    t = Tensor::contiguous(p.q.data(), DType::kFloat8E4M3, {p.rows, p.cols});
    s = Tensor::contiguous(p.scale.data(), DType::kFloat32, {(p.rows + 127) / 128, p.cols / 128});
  };
  moelink::MLAWeights v;
  if (!input_layernorm.empty())
    v.input_layernorm = Tensor::contiguous(input_layernorm.data(), DType::kFloat32,
                                           {static_cast<int64_t>(input_layernorm.size())});
  v.q_a_layernorm = Tensor::contiguous(q_a_layernorm.data(), DType::kFloat32,
                                       {static_cast<int64_t>(q_a_layernorm.size())});
  v.kv_a_layernorm = Tensor::contiguous(kv_a_layernorm.data(), DType::kFloat32,
                                        {static_cast<int64_t>(kv_a_layernorm.size())});
  proj(q_a, v.q_a_proj, v.q_a_proj_scale);
  proj(kv_a, v.kv_a_proj_with_mqa, v.kv_a_proj_with_mqa_scale);
  proj(q_b, v.q_b_proj, v.q_b_proj_scale);
  proj(kv_b, v.kv_b_proj, v.kv_b_proj_scale);
  proj(o, v.o_proj, v.o_proj_scale);
  return v;
}

namespace {

std::vector<double> normed_input(const MLATestWeights& w, const uint16_t* x_row) {
  const MLAConfig& c = w.config;
  std::vector<double> h = row_of(x_row, c.hidden_size);
  if (!w.input_layernorm.empty()) h = rms_norm(h, w.input_layernorm, c.rms_norm_eps);
  return h;
}

}  // namespace

namespace {

// One token's projections: q [H, Dn + Dr] with its rotary dims roped, the
// latent after kv_a_layernorm [R], the roped rotary key dims [Dr].
// `stored`: every tensor rounded to bf16 as the module stores it (the cache
// row's definition).
struct TokenState {
  std::vector<double> q, latent, k_rot;
};

TokenState token_state(const MLATestWeights& w, const uint16_t* x_row, int64_t pos, bool quantize,
                       bool stored_bf16) {
  const MLAConfig& c = w.config;
  const int64_t H = c.num_attention_heads, R = c.kv_lora_rank, Dn = c.qk_nope_head_dim,
                Dr = c.qk_rope_head_dim;
  auto stored = [&](std::vector<double> v) { return stored_bf16 ? rounded_bf16(std::move(v)) : v; };
  const Rope rp = make_rope(c);
  const std::vector<double> h = normed_input(w, x_row);
  const std::vector<double> kv = stored(project(w.kv_a, h, quantize));
  const std::vector<double> qa = rms_norm(stored(project(w.q_a, h, quantize)), w.q_a_layernorm, c.rms_norm_eps);
  TokenState t;
  t.q = project(w.q_b, qa, quantize);
  for (int64_t i = 0; i < H; ++i) {
    double* qh = &t.q[i * (Dn + Dr)];
    const std::vector<double> r = rope(rp, std::vector<double>(qh + Dn, qh + Dn + Dr), pos, c.rope_interleave);
    std::copy(r.begin(), r.end(), qh + Dn);
  }
  t.latent = rms_norm(std::vector<double>(kv.begin(), kv.begin() + R), w.kv_a_layernorm, c.rms_norm_eps);
  t.k_rot = stored(rope(rp, std::vector<double>(kv.begin() + R, kv.end()), pos, c.rope_interleave));
  return t;
}

}  // namespace

std::vector<double> ref_cache_row(const MLATestWeights& w, const uint16_t* x_row, int64_t pos) {
  const TokenState t = token_state(w, x_row, pos, true, true);
  std::vector<double> row = t.latent;
  row.insert(row.end(), t.k_rot.begin(), t.k_rot.end());
  return row;
}

std::vector<double> ref_mla(const MLATestWeights& w, const uint16_t* x, int64_t L, int64_t from,
                            RefFlow flow) {
  const MLAConfig& c = w.config;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, Dn = c.qk_nope_head_dim,
                Dr = c.qk_rope_head_dim, Dv = c.v_head_dim;
  const bool quantize = flow == RefFlow::kHF;
  std::vector<TokenState> tok(L);
  std::vector<std::vector<double>> kvb(L);  // per head: k_nope, v
  for (int64_t s = 0; s < L; ++s) {
    tok[s] = token_state(w, x + s * D, s, quantize, false);
    kvb[s] = project(w.kv_b, tok[s].latent, false);
  }
  const double scale = c.softmax_scale();
  std::vector<double> out((L - from) * D);
  for (int64_t t = from; t < L; ++t) {
    std::vector<double> attn(H * Dv, 0.0), p(t + 1);
    for (int64_t h = 0; h < H; ++h) {
      const double* qh = &tok[t].q[h * (Dn + Dr)];
      double mx = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        double dot = 0;
        for (int64_t d = 0; d < Dn; ++d) dot += qh[d] * kvb[s][h * (Dn + Dv) + d];
        for (int64_t d = 0; d < Dr; ++d) dot += qh[Dn + d] * tok[s].k_rot[d];
        p[s] = dot * scale;
        mx = std::max(mx, p[s]);
      }
      double sum = 0;
      for (int64_t s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
      for (int64_t s = 0; s <= t; ++s)
        for (int64_t d = 0; d < Dv; ++d) attn[h * Dv + d] += p[s] / sum * kvb[s][h * (Dn + Dv) + Dn + d];
    }
    const std::vector<double> o = project(w.o, attn, quantize);
    std::copy(o.begin(), o.end(), out.begin() + (t - from) * D);
  }
  return out;
}

}  // namespace moelink_test
