// ModelOps on the host: plain loops, fp32 arithmetic, bf16 storage.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/float_convert.h"
#include "core/device_memory.h"
#include "core/rms_norm.h"
#include "model/draft_rules.h"
#include "model/model_ops.h"
#include "model/sampling.h"
#include "moelink/errors.h"

namespace moelink::detail::model {
namespace {

uint16_t* row_of(const Tensor& t, int64_t r) { return static_cast<uint16_t*>(t.data) + r * t.stride[0]; }

float dot_bf16(const std::vector<float>& x, const uint16_t* w) {
  float acc = 0.0f;
  for (size_t d = 0; d < x.size(); ++d) acc += x[d] * bf16_to_f32(w[d]);
  return acc;
}

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

  void rebase_offsets(int32_t* dst, const int32_t* src, int first, int count, cudaStream_t) override {
    const int32_t base = src[first];
    for (int i = 0; i <= count; ++i) dst[i] = src[first + i] - base;
  }

  void move_rows(const Tensor& part, const Tensor& whole, const int32_t* first, const int32_t* count,
                 bool into_part, cudaStream_t) override {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(*count, 0), part.shape[0]), D = part.shape[1];
    auto* p = static_cast<uint16_t*>(part.data);
    auto* w = static_cast<uint16_t*>(whole.data) + static_cast<int64_t>(*first) * whole.stride[0];
    for (int64_t r = 0; r < n; ++r) {
      uint16_t* a = p + r * part.stride[0];
      uint16_t* b = w + r * whole.stride[0];
      if (into_part)
        std::memcpy(a, b, D * 2);
      else
        std::memcpy(b, a, D * 2);
    }
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
    auto* hd = static_cast<uint16_t*>(h.data);
    residual_rms_norm_rows(hd, h.stride[0], x.defined() ? static_cast<const uint16_t*>(x.data) : nullptr,
                           x.defined() ? x.stride[0] : 0, hd, h.stride[0],
                           normed.defined() ? static_cast<uint16_t*>(normed.data) : nullptr,
                           normed.defined() ? normed.stride[0] : 0, h.shape[1], weight, eps, *rows);
  }

  void linear(const Tensor& out, const Tensor& x, const uint16_t* weight, const int32_t* rows,
              cudaStream_t) override {
    const int64_t N = out.shape[1], K = x.shape[1];
    std::vector<float> xv(K);
    for (int64_t r = 0; r < *rows; ++r) {
      for (int64_t k = 0; k < K; ++k) xv[k] = bf16_to_f32(row_of(x, r)[k]);
      uint16_t* o = row_of(out, r);
      for (int64_t n = 0; n < N; ++n) o[n] = f32_to_bf16(dot_bf16(xv, weight + n * K));
    }
  }

  void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
               const int32_t* rows, const int32_t* row_index, cudaStream_t) override {
    const int64_t D = h.shape[1];
    const int64_t k = row_index ? logits.shape[0] : *rows;
    std::vector<float> hv(D);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = row_index ? row_index[j] : j;
      if (r < 0 || r >= *rows) continue;
      const uint16_t* hr = row_of(h, r);
      for (int64_t d = 0; d < D; ++d) hv[d] = bf16_to_f32(hr[d]);
      float* out = static_cast<float*>(logits.data) + j * logits.stride[0];
      for (int64_t v = 0; v < vocab; ++v) out[v] = dot_bf16(hv, weight + v * D);
    }
  }

  void plan_samples(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts, int num_requests,
                    int slots, const int32_t* rows, int32_t* row_index, int32_t* position, ModelErrorRecord* error,
                    cudaStream_t) override {
    for (int i = 0; i < num_requests; ++i)
      if (plan_request_samples(q_start, kv_len, num_drafts, i, slots, *rows, row_index, position).bad_drafts)
        record(error, 3, 0, i, num_drafts[i],
               std::max(0, std::min(slots - 1, q_start[i + 1] - q_start[i] - 1)));
  }

  void sample(const Tensor& tokens, const Tensor& logits, const Tensor& temperature, const Tensor& top_k,
              const Tensor& top_p, const Tensor& seed, const int32_t* row_index, const int32_t* position,
              int slots, ModelErrorRecord* error, cudaStream_t) override {
    const int64_t V = logits.shape[1];
    auto* out = static_cast<int32_t*>(tokens.data);
    std::vector<int32_t> order(V);
    std::vector<double> p(V);
    for (int64_t j = 0; j < tokens.shape[0]; ++j) {
      const int64_t i = j / slots;  // the request
      int32_t& tok = out[j * tokens.stride[0]];
      if (row_index[j] < 0) {
        tok = -1;
        continue;
      }
      const float* l = static_cast<const float*>(logits.data) + j * logits.stride[0];
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
      for (int64_t q = 0; q < keep; ++q) sum += (p[q] = std::exp((l[order[q]] - l[order[0]]) / t));
      int64_t cut = keep;  // the smallest prefix whose mass reaches top_p
      double mass = 0.0;
      for (int64_t q = 0; q < keep; ++q) {
        mass += p[q] / sum;
        if (mass >= tp) {
          cut = q + 1;
          break;
        }
      }
      double total = 0.0;
      for (int64_t q = 0; q < cut; ++q) total += p[q];
      const double u =
          sample_uniform(seed.defined() ? static_cast<const int64_t*>(seed.data)[i] : 0, position[j]) * total;
      double acc = 0.0;
      tok = order[cut - 1];
      for (int64_t q = 0; q < cut; ++q) {
        acc += p[q];
        if (u < acc) {
          tok = order[q];
          break;
        }
      }
    }
  }

  void accept_drafts(const int32_t* samples, const int32_t* row_index, int slots, const Tensor& token_ids,
                     const int32_t* q_start, const int32_t* known_next, int num_requests,
                     int32_t* next_tokens, int64_t next_stride,
                     int32_t* accepted, int32_t* mtp_tokens, int32_t* draft_row, cudaStream_t) override {
    const auto* ids = static_cast<const int32_t*>(token_ids.data);
    const int64_t ids_stride = token_ids.defined() ? token_ids.stride[0] : 1;
    for (int i = 0; i < num_requests; ++i) {
      const int32_t* slot_rows = row_index + i * slots;
      const int32_t* slot_tokens = samples + i * slots;
      const int32_t a = accepted_drafts(slot_tokens, slot_rows, slots, ids, ids_stride);
      next_tokens[i * next_stride] = slot_rows[0] < 0 ? -1 : slot_tokens[a];
      if (accepted) accepted[i] = a;
      if (!mtp_tokens) continue;
      const int32_t first = slot_rows[0], last = q_start[i + 1] - 1;
      draft_row[i] = first < 0 ? -1 : first + a;
      if (first < 0) continue;  // plan_samples kept its rows below rows
      const int32_t known = known_next && last == first ? known_next[i] : -1;
      for (int64_t r = q_start[i]; r <= last; ++r)
        mtp_tokens[r] = mtp_input_token(r, first, last, ids, ids_stride, slot_tokens, known);
    }
  }

  ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t) override {
    const ModelErrorRecord e = *record;
    *record = {};
    return e;
  }
  void run_check(cudaStream_t, const std::function<void()>& check) override { check(); }

  std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>&) override {
    throw InvalidArgument("moelink: Model: CUDA graphs need a GPU backend");
  }
  void replay(Graph&, cudaStream_t) override {
    throw InvalidArgument("moelink: Model: CUDA graphs need a GPU backend");
  }
};

}  // namespace

std::unique_ptr<ModelOps> make_cpu_model_ops() { return std::make_unique<CpuModelOps>(); }

}  // namespace moelink::detail::model
