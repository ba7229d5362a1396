// ModelOps on the host: plain loops, fp32 arithmetic, bf16 storage.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/float_convert.h"
#include "core/device_memory.h"
#include "model/model_ops.h"
#include "model/sampling.h"
#include "moelink/errors.h"

namespace moelink::detail::model {
namespace {

uint16_t* row_of(const Tensor& t, int64_t r) { return static_cast<uint16_t*>(t.data) + r * t.stride[0]; }

void record(ModelErrorRecord* e, int32_t code, int32_t field, int64_t row, double value, int64_t limit) {
  if (e->code == 0) *e = {code, field, row, value, limit};
}

class CpuModelOps final : public HostMemory<ModelOps> {
 public:
  void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
  }
  void sync(cudaStream_t) override {}

  void step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows,
                 cudaStream_t) override {
    const int32_t last = q_start[num_requests];
    *rows = last >= 0 && last <= n ? last : 0;
  }

  void embed(const Tensor& h, const Tensor& token_ids, const uint16_t* table, int64_t vocab,
             const int32_t* rows, ModelErrorRecord* error, cudaStream_t) override {
    const int64_t D = h.shape[1];
    const auto* ids = static_cast<const int32_t*>(token_ids.data);
    for (int64_t r = 0; r < *rows; ++r) {
      const int32_t id = ids[r * token_ids.stride[0]];
      uint16_t* out = row_of(h, r);
      if (id < 0 || id >= vocab) {
        record(error, 1, 0, r, id, vocab);
        std::fill(out, out + D, 0);
        continue;
      }
      std::memcpy(out, table + static_cast<int64_t>(id) * D, D * 2);
    }
  }

  void add_rms_norm(const Tensor& h, const Tensor& x, const Tensor& normed, const float* weight,
                    float eps, const int32_t* rows, cudaStream_t) override {
    const int64_t D = h.shape[1];
    std::vector<float> v(D);
    for (int64_t r = 0; r < *rows; ++r) {
      uint16_t* hr = row_of(h, r);
      float ss = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        float s = bf16_to_f32(hr[d]);
        if (x.defined()) {
          s += bf16_to_f32(row_of(x, r)[d]);
          hr[d] = f32_to_bf16(s);
          s = bf16_to_f32(hr[d]);  // the residual stream is bf16, as in HF's bf16 model
        }
        v[d] = s;
        ss += s * s;
      }
      if (weight == nullptr) continue;
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      uint16_t* out = row_of(normed, r);
      for (int64_t d = 0; d < D; ++d) out[d] = f32_to_bf16(v[d] * inv * weight[d]);
    }
  }

  void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
               const int32_t* rows, const int32_t* q_start, int num_requests, cudaStream_t) override {
    const int64_t D = h.shape[1];
    const int64_t k = q_start ? num_requests : *rows;
    std::vector<float> hv(D);
    for (int64_t j = 0; j < k; ++j) {
      int64_t r = j;
      if (q_start) {
        if (q_start[j + 1] <= q_start[j] || q_start[j + 1] > *rows) continue;
        r = q_start[j + 1] - 1;
      }
      const uint16_t* hr = row_of(h, r);
      for (int64_t d = 0; d < D; ++d) hv[d] = bf16_to_f32(hr[d]);
      float* out = static_cast<float*>(logits.data) + j * logits.stride[0];
      for (int64_t v = 0; v < vocab; ++v) {
        const uint16_t* w = weight + v * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += hv[d] * bf16_to_f32(w[d]);
        out[v] = acc;
      }
    }
  }

  void sample(const Tensor& next_tokens, const Tensor& logits, const Tensor& temperature,
              const Tensor& top_k, const Tensor& top_p, const Tensor& seed, const int32_t* q_start,
              const int32_t* kv_len, int num_requests, ModelErrorRecord* error, cudaStream_t) override {
    const int64_t V = logits.shape[1];
    auto* out = static_cast<int32_t*>(next_tokens.data);
    std::vector<int32_t> order(V);
    std::vector<double> p(V);
    for (int i = 0; i < num_requests; ++i) {
      int32_t& tok = out[i * next_tokens.stride[0]];
      if (q_start[i + 1] <= q_start[i]) {
        tok = -1;
        continue;
      }
      const float* l = static_cast<const float*>(logits.data) + i * logits.stride[0];
      const float t = temperature.defined() ? static_cast<const float*>(temperature.data)[i] : 0.0f;
      const int32_t k = top_k.defined() ? static_cast<const int32_t*>(top_k.data)[i] : 0;
      const float tp = top_p.defined() ? static_cast<const float*>(top_p.data)[i] : 1.0f;
      if (!(t >= 0.0f) || k < 0 || !(tp > 0.0f && tp <= 1.0f)) {
        const int field = !(t >= 0.0f) ? 0 : k < 0 ? 1 : 2;
        record(error, 2, field, i, field == 0 ? t : field == 1 ? k : tp, 0);
        tok = -1;
        continue;
      }
      if (t == 0.0f) {  // greedy: the first largest
        tok = static_cast<int32_t>(std::max_element(l, l + V) - l);
        continue;
      }
      std::iota(order.begin(), order.end(), 0);
      const int64_t keep = k > 0 ? std::min<int64_t>(k, V) : V;
      std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                        [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
      double sum = 0.0;
      for (int64_t j = 0; j < keep; ++j) sum += (p[j] = std::exp((l[order[j]] - l[order[0]]) / t));
      int64_t cut = keep;  // the smallest prefix whose mass reaches top_p
      double mass = 0.0;
      for (int64_t j = 0; j < keep; ++j) {
        mass += p[j] / sum;
        if (mass >= tp) {
          cut = j + 1;
          break;
        }
      }
      double total = 0.0;
      for (int64_t j = 0; j < cut; ++j) total += p[j];
      const int64_t position = kv_len[i] - 1;
      const double u = sample_uniform(seed.defined() ? static_cast<const int64_t*>(seed.data)[i] : 0,
                                      position) * total;
      double acc = 0.0;
      tok = order[cut - 1];
      for (int64_t j = 0; j < cut; ++j) {
        acc += p[j];
        if (u < acc) {
          tok = order[j];
          break;
        }
      }
    }
  }

  ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t) override {
    const ModelErrorRecord e = *record;
    *record = {};
    return e;
  }
};

}  // namespace

std::unique_ptr<ModelOps> make_cpu_model_ops() { return std::make_unique<CpuModelOps>(); }

}  // namespace moelink::detail::model
