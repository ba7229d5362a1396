// AttentionOps on the host: plain loops over host tensors, in fp32 with the
// bf16 roundings the GPU kernels make (every stored tensor is bf16).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "attention/attention_ops.h"
#include "core/float_convert.h"
#include "core/device_memory.h"
#include "core/rms_norm.h"

namespace moelink::detail::attention {

namespace {

struct CpuPrefillState final : AttentionOps::PrefillState {
  int64_t rows = 0;
  int heads = 0, v_dims = 0;
  std::vector<float> max, sum, acc;  // [rows, heads], [rows, heads], [rows, heads, v_dims]
};

uint16_t* bf16_row(const Tensor& t, int64_t r) {
  return static_cast<uint16_t*>(t.data) + r * t.stride[0];
}
uint16_t* bf16_at(const Tensor& t, int64_t a, int64_t b) {  // 3-D [a][b][:]
  return static_cast<uint16_t*>(t.data) + a * t.stride[0] + b * t.stride[1];
}
float f(uint16_t h) { return bf16_to_f32(h); }
uint16_t bf(float v) { return f32_to_bf16(v); }

class CpuAttentionOps final : public HostMemory<AttentionOps> {
 public:
  void sync(cudaStream_t) override {}
  void set_count(int32_t* dst, int32_t value, cudaStream_t) override { *dst = value; }

  void plan_step(const MLABatch& b, int64_t n, const StepBounds& bounds, int local_heads,
                 const RowPlan& plan, StepErrorRecord* error, cudaStream_t) override {
    const auto* q_start = static_cast<const int32_t*>(b.q_start.data);
    const auto* kv_len = static_cast<const int32_t*>(b.kv_len.data);
    std::fill(plan.request, plan.request + n, -1);
    std::fill(plan.position, plan.position + n, 0);
    const int64_t rows = step_rows(q_start, b.num_requests, b.num_decode, n, error);
    *plan.rows = static_cast<int32_t>(rows);
    const int32_t decode_rows = rows > 0 ? q_start[b.num_decode] : 0;
    std::fill(plan.decode_rows, plan.decode_rows + local_heads, decode_rows);
    if (rows == 0) return;
    for (int i = 0; i < b.num_requests; ++i) {
      const int32_t* block_row = static_cast<const int32_t*>(b.block_table.data) + i * b.block_table.stride[0];
      if (!request_ok(i, q_start, kv_len, block_row, bounds, error)) continue;
      const int32_t q_len = q_start[i + 1] - q_start[i];
      for (int32_t j = 0; j < q_len; ++j) {
        plan.request[q_start[i] + j] = i;
        plan.position[q_start[i] + j] = kv_len[i] - q_len + j;
      }
    }
  }

  void rms_norm(const Tensor& y, const Tensor& x, const float* weight, float eps, const int32_t* rows,
                cudaStream_t) override {
    residual_rms_norm_rows(static_cast<const uint16_t*>(x.data), x.stride[0], nullptr, 0, nullptr, 0,
                           static_cast<uint16_t*>(y.data), y.stride[0], x.shape[1], weight, eps, *rows);
  }

  void rope_q(const Tensor& q, int heads, int head_dim, int rope_dims, const RowPlan& plan,
              const float* inv_freq, float attention_factor, bool interleaved, cudaStream_t) override {
    std::vector<float> v(rope_dims);
    for (int64_t r = 0; r < *plan.rows; ++r) {
      if (plan.request[r] < 0) continue;
      for (int h = 0; h < heads; ++h) {
        uint16_t* p = bf16_row(q, r) + static_cast<int64_t>(h) * head_dim + (head_dim - rope_dims);
        for (int d = 0; d < rope_dims; ++d) v[d] = f(p[d]);
        rope_rotate(v.data(), rope_dims, plan.position[r], inv_freq, attention_factor, interleaved);
        for (int d = 0; d < rope_dims; ++d) p[d] = bf(v[d]);
      }
    }
  }

  void append_kv(const Tensor& cache, const Tensor& latent, const Tensor& kpe, const MLABatch& b,
                 const RowPlan& plan, const float* inv_freq, float attention_factor,
                 bool interleaved, cudaStream_t) override {
    const int64_t R = latent.shape[1], Dr = kpe.shape[1], page = cache.shape[1];
    std::vector<float> v(Dr);
    for (int64_t r = 0; r < *plan.rows; ++r) {
      const int32_t i = plan.request[r];
      if (i < 0) continue;
      const int32_t pos = plan.position[r];
      const int32_t pid = static_cast<const int32_t*>(b.block_table.data)[i * b.block_table.stride[0] + pos / page];
      uint16_t* row = bf16_at(cache, pid, pos % page);
      std::memcpy(row, bf16_row(latent, r), R * 2);
      const uint16_t* k = bf16_row(kpe, r);
      for (int64_t d = 0; d < Dr; ++d) v[d] = f(k[d]);
      rope_rotate(v.data(), static_cast<int>(Dr), pos, inv_freq, attention_factor, interleaved);
      for (int64_t d = 0; d < Dr; ++d) row[R + d] = bf(v[d]);
    }
  }

  void split_heads(const Tensor& dst, const Tensor& src, int heads, int64_t head_stride,
                   int64_t offset, const int32_t* rows, cudaStream_t) override {
    const int64_t width = dst.shape[2];
    for (int h = 0; h < heads; ++h)
      for (int64_t r = 0; r < *rows; ++r)
        std::memcpy(bf16_at(dst, h, r), bf16_row(src, r) + h * head_stride + offset, width * 2);
  }

  void merge_heads(const Tensor& dst, const Tensor& src, int heads, const int32_t* rows,
                   cudaStream_t) override {
    const int64_t width = src.shape[2];
    for (int64_t r = 0; r < *rows; ++r)
      for (int h = 0; h < heads; ++h)
        std::memcpy(bf16_row(dst, r) + h * width, bf16_at(src, h, r), width * 2);
  }

  void head_gemm(const Tensor& y, const Tensor& x, const uint16_t* w, int64_t rows_bound, const int32_t* rows,
                 cudaStream_t) override {
    const int64_t heads = y.shape[0], N = y.shape[2], K = x.shape[2];
    const int64_t count = std::min<int64_t>(rows_bound, *rows);
    std::vector<float> xf(K);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < count; ++r) {
        const uint16_t* xr = bf16_at(x, h, r);
        for (int64_t k = 0; k < K; ++k) xf[k] = bf16_to_f32(xr[k]);
        uint16_t* yr = bf16_at(y, h, r);
        for (int64_t n = 0; n < N; ++n) {
          const uint16_t* wr = w + (h * N + n) * K;
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k) acc += xf[k] * bf16_to_f32(wr[k]);
          yr[n] = f32_to_bf16(acc);
        }
      }
  }

  void decode_attention(const Tensor& out_latent, const Tensor& q_latent, const Tensor& q,
                        const Tensor& cache, const MLABatch& b, const RowPlan& plan, int heads,
                        int nope_dims, float scale, cudaStream_t) override {
    const int64_t R = q_latent.shape[2], Dc = cache.shape[2], Dr = Dc - R, page = cache.shape[1];
    const int64_t head_dim = nope_dims + Dr;
    const int32_t rows = *plan.decode_rows;
    std::vector<float> scores, acc(R), ql(R), qp(Dr);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t i = plan.request[r];
      for (int h = 0; h < heads; ++h) {
        uint16_t* out = bf16_at(out_latent, h, r);
        if (i < 0) {
          std::fill(out, out + R, 0);
          continue;
        }
        const uint16_t* qlr = bf16_at(q_latent, h, r);
        const uint16_t* qpr = bf16_row(q, r) + h * head_dim + nope_dims;
        for (int64_t d = 0; d < R; ++d) ql[d] = f(qlr[d]);
        for (int64_t d = 0; d < Dr; ++d) qp[d] = f(qpr[d]);
        const int64_t keys = plan.position[r] + 1;
        const int32_t* block_row = static_cast<const int32_t*>(b.block_table.data) + i * b.block_table.stride[0];
        scores.resize(keys);
        float mx = -INFINITY;
        for (int64_t s = 0; s < keys; ++s) {
          const uint16_t* k = bf16_at(cache, block_row[s / page], s % page);
          float dot = 0.0f;
          for (int64_t d = 0; d < R; ++d) dot += ql[d] * f(k[d]);
          for (int64_t d = 0; d < Dr; ++d) dot += qp[d] * f(k[R + d]);
          scores[s] = dot * scale;
          mx = std::max(mx, scores[s]);
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < keys; ++s) {
          const float p = std::exp(scores[s] - mx);
          sum += p;
          const uint16_t* k = bf16_at(cache, block_row[s / page], s % page);
          for (int64_t d = 0; d < R; ++d) acc[d] += p * f(k[d]);
        }
        for (int64_t d = 0; d < R; ++d) out[d] = bf(acc[d] / sum);
      }
    }
  }

  std::unique_ptr<PrefillState> prefill_begin(int64_t query_rows, int heads, int v_dims,
                                              cudaStream_t) override {
    auto s = std::make_unique<CpuPrefillState>();
    s->rows = query_rows;
    s->heads = heads;
    s->v_dims = v_dims;
    s->max.assign(query_rows * heads, -INFINITY);
    s->sum.assign(query_rows * heads, 0.0f);
    s->acc.assign(query_rows * heads * v_dims, 0.0f);
    return s;
  }

  void gather_kv(const Tensor& latent, const Tensor& k_pe, const Tensor& cache,
                 const int32_t* block_row, int page_size, int64_t first, int64_t count,
                 cudaStream_t) override {
    const int64_t R = latent.shape[1], Dr = k_pe.shape[1];
    for (int64_t s = 0; s < count; ++s) {
      const int64_t p = first + s;
      const uint16_t* row = bf16_at(cache, block_row[p / page_size], p % page_size);
      std::memcpy(bf16_row(latent, s), row, R * 2);
      std::memcpy(bf16_row(k_pe, s), row + R, Dr * 2);
    }
  }

  void prefill_chunk(PrefillState& state, const Tensor& q, int64_t q_row0, int64_t q_rows,
                     int64_t q_pos0, const Tensor& kv, const Tensor& k_pe, int64_t k_pos0,
                     int heads, int nope_dims, int rope_dims, int v_dims, float scale,
                     cudaStream_t) override {
    auto& st = static_cast<CpuPrefillState&>(state);
    const int64_t keys = kv.shape[0], head_dim = nope_dims + rope_dims, kv_head = nope_dims + v_dims;
    std::vector<float> scores(keys), qv(head_dim);
    for (int64_t j = 0; j < q_rows; ++j) {
      const int64_t pos = q_pos0 + j;
      const int64_t visible = std::min<int64_t>(keys, pos - k_pos0 + 1);  // causal
      if (visible <= 0) continue;
      for (int h = 0; h < heads; ++h) {
        const uint16_t* qr = bf16_row(q, q_row0 + j) + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qv[d] = f(qr[d]);
        float mx = -INFINITY;
        for (int64_t s = 0; s < visible; ++s) {
          const uint16_t* k = bf16_row(kv, s) + h * kv_head;
          const uint16_t* kr = bf16_row(k_pe, s);
          float dot = 0.0f;
          for (int d = 0; d < nope_dims; ++d) dot += qv[d] * f(k[d]);
          for (int d = 0; d < rope_dims; ++d) dot += qv[nope_dims + d] * f(kr[d]);
          scores[s] = dot * scale;
          mx = std::max(mx, scores[s]);
        }
        // Fold into the running softmax: rescale what was summed so far.
        const int64_t at = j * heads + h;
        const float new_max = std::max(st.max[at], mx);
        const float carry = std::exp(st.max[at] - new_max);
        float* acc = &st.acc[at * v_dims];
        st.sum[at] *= carry;
        for (int d = 0; d < v_dims; ++d) acc[d] *= carry;
        for (int64_t s = 0; s < visible; ++s) {
          const float p = std::exp(scores[s] - new_max);
          st.sum[at] += p;
          const uint16_t* v = bf16_row(kv, s) + h * kv_head + nope_dims;
          for (int d = 0; d < v_dims; ++d) acc[d] += p * f(v[d]);
        }
        st.max[at] = new_max;
      }
    }
  }

  void prefill_finish(PrefillState& state, const Tensor& out, int64_t row0, cudaStream_t) override {
    auto& st = static_cast<CpuPrefillState&>(state);
    for (int64_t j = 0; j < st.rows; ++j)
      for (int h = 0; h < st.heads; ++h) {
        const int64_t at = j * st.heads + h;
        uint16_t* o = bf16_row(out, row0 + j) + static_cast<int64_t>(h) * st.v_dims;
        for (int d = 0; d < st.v_dims; ++d)
          o[d] = bf(st.sum[at] > 0.0f ? st.acc[at * st.v_dims + d] / st.sum[at] : 0.0f);
      }
  }

  void zero_rows(const Tensor& dst, int64_t row0, int64_t rows, cudaStream_t) override {
    for (int64_t r = row0; r < row0 + rows; ++r) std::fill(bf16_row(dst, r), bf16_row(dst, r) + dst.shape[1], 0);
  }

  StepErrorRecord take_error(StepErrorRecord* record, cudaStream_t) override {
    const StepErrorRecord e = *record;
    *record = {};
    return e;
  }
};

}  // namespace

std::unique_ptr<AttentionOps> make_cpu_attention_ops() { return std::make_unique<CpuAttentionOps>(); }

}  // namespace moelink::detail::attention
