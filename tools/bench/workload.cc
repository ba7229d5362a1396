#include "workload.h"

#include <algorithm>

#include "numeric.h"

namespace moelink_bench {

namespace {

// splitmix64: tiny, fast, good enough for benchmark inputs.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>((next() >> 32) * n >> 32); }
};

uint64_t mix(uint64_t a, uint64_t b) { return Rng(a * 0x100000001b3ull ^ b).next(); }

enum Stream : uint64_t { kTokens = 1, kScales = 2, kRouting = 3 };

uint64_t stream_seed(uint64_t seed, int64_t T, int group, int p, Stream s) {
  return mix(mix(mix(mix(seed, static_cast<uint64_t>(T)), group), p), s);
}

// Top-k of a real router: k distinct experts, uniformly at random; weights
// positive and normalized like a softmax over the selected logits.
RoutingSet make_routing(uint64_t seed, int64_t T, int E, int k) {
  RoutingSet r;
  r.indices.resize(T * k);
  r.weights.resize(T * k);
  Rng rng(seed);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* idx = &r.indices[t * k];
    float* w = &r.weights[t * k];
    float sum = 0;
    for (int i = 0; i < k; ++i) {
      int32_t e;
      do e = static_cast<int32_t>(rng.below(static_cast<uint32_t>(E)));
      while (std::find(idx, idx + i, e) != idx + i);
      idx[i] = e;
      w[i] = static_cast<float>(0.05 + rng.uniform());
      sum += w[i];
    }
    for (int i = 0; i < k; ++i) w[i] /= sum;
  }
  return r;
}

}  // namespace

Workload make_workload(const BenchOptions& o, const moelink::Config& c) {
  Workload w;
  w.config = c;
  w.T = c.max_num_tokens;
  w.H = c.hidden_dim;
  w.S = c.hidden_dim_scale;
  w.k = c.experts_per_token;
  w.W = c.world_size;
  w.D = c.dp_size;
  w.L = c.num_local_experts();
  w.in_bytes = moelink::dtype_size(c.in_dtype);
  w.out_bytes = moelink::dtype_size(c.out_dtype);
  const int G = c.num_dp_groups(), my_group = c.dp_group();
  const int64_t T = w.T, H = w.H;

  // Tokens: random bytes for fp8 with the NaN codes (0x7f, 0xff) nudged to
  // the largest finite value; random values in [-2, 2) for bf16/fp16.
  w.x.resize(static_cast<size_t>(T * H) * w.in_bytes);
  Rng rx(stream_seed(o.seed, T, my_group, 0, kTokens));
  if (c.in_dtype == moelink::DType::kFloat8E4M3) {
    for (size_t i = 0; i < w.x.size(); i += 8) {
      uint64_t v = rx.next();
      for (size_t b = 0; b < 8 && i + b < w.x.size(); ++b) {
        uint8_t byte = static_cast<uint8_t>(v >> (8 * b));
        if ((byte & 0x7f) == 0x7f) byte ^= 1;
        w.x[i + b] = byte;
      }
    }
  } else {
    auto* h = reinterpret_cast<uint16_t*>(w.x.data());
    const bool bf16 = c.in_dtype == moelink::DType::kBFloat16;
    for (int64_t i = 0; i < T * H; ++i) {
      float f = static_cast<float>(rx.uniform() * 4.0 - 2.0);
      h[i] = float_to_out(f, bf16);
    }
  }
  w.scales.resize(static_cast<size_t>(T * w.S));
  Rng rs(stream_seed(o.seed, T, my_group, 0, kScales));
  for (float& s : w.scales) s = static_cast<float>(0.5 + rs.uniform());

  // Routing of every group: this rank keeps its own, and counts the traffic
  // of all (each token leaves from the replica t % D of its group).
  for (int p = 0; p < o.pool; ++p) {
    Traffic tr;
    const int W = w.W, D = w.D, L = w.L, k = w.k;
    tr.dispatch_rows.assign(static_cast<size_t>(W) * W, 0);
    tr.combine_rows.assign(static_cast<size_t>(W) * W, 0);
    tr.routes_to_rank.assign(W, 0);
    tr.my_expert_counts.assign(L, 0);
    std::vector<char> hit(W);
    for (int g = 0; g < G; ++g) {
      RoutingSet rs_g = make_routing(stream_seed(o.seed, T, g, p, kRouting), T, c.num_experts, k);
      for (int64_t t = 0; t < T; ++t) {
        std::fill(hit.begin(), hit.end(), 0);
        for (int i = 0; i < k; ++i) {
          int e = rs_g.indices[t * k + i];
          int r = e / L;
          hit[r] = 1;
          tr.routes_to_rank[r]++;
          if (r == c.rank) tr.my_expert_counts[e % L]++;
        }
        const int sender = g * D + static_cast<int>(t % D);
        for (int r = 0; r < W; ++r) {
          if (!hit[r]) continue;
          tr.dispatch_rows[static_cast<size_t>(sender) * W + r]++;
          for (int q = g * D; q < (g + 1) * D; ++q) tr.combine_rows[static_cast<size_t>(r) * W + q]++;
        }
      }
      if (g == my_group) w.pool.push_back(std::move(rs_g));
    }
    w.traffic.push_back(std::move(tr));
  }
  return w;
}

std::vector<float> expected_combine(const Workload& w, int p) {
  const int64_t T = w.T, H = w.H;
  const int k = w.k, S = w.S, L = w.L, W = w.W;
  const bool out_bf16 = w.config.out_dtype == moelink::DType::kBFloat16;
  const RoutingSet& rs = w.pool[p];
  std::vector<float> out(static_cast<size_t>(T * H));
  std::vector<float> y(H), part(static_cast<size_t>(W) * H);
  std::vector<char> hit(W);
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* row = &w.x[static_cast<size_t>(t * H) * w.in_bytes];
    for (int64_t h = 0; h < H; ++h) {
      float s = S > 0 ? w.scales[t * S + scale_index(h, H, S)] : 1.0f;
      y[h] = bf16_to_float(float_to_bf16(load_token_elem(row, w.config.in_dtype, h) * s));
    }
    std::fill(part.begin(), part.end(), 0.0f);
    std::fill(hit.begin(), hit.end(), 0);
    for (int i = 0; i < k; ++i) {
      int r = rs.indices[t * k + i] / L;
      hit[r] = 1;
      float wt = rs.weights[t * k + i];
      for (int64_t h = 0; h < H; ++h) part[r * H + h] += wt * y[h];
    }
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0;
      for (int r = 0; r < W; ++r)
        if (hit[r]) acc += out_to_float(float_to_out(part[r * H + h], out_bf16), out_bf16);
      out[t * H + h] = acc;
    }
  }
  return out;
}

}  // namespace moelink_bench
