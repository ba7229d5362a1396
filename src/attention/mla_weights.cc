#include "attention/mla_weights.h"

#include <algorithm>
#include <cstring>

#include "core/arg_checks.h"
#include "core/float_convert.h"
#include "layer/block_quant.h"
#include "moelink/errors.h"

namespace moelink::detail::attention {

namespace {

constexpr int64_t kBlock = 128;

int64_t round_up(int64_t v) { return (v + kBlock - 1) / kBlock * kBlock; }

void require_packed(const char* call, const char* field, const Tensor& t) {
  int64_t expect = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] > 1 && t.stride[d] != expect)
      bad(call, field, "must be contiguous, got shape " + shape_str(t));
    expect *= t.shape[d];
  }
}

void require_shape(const char* call, const char* field, const Tensor& t,
                   std::initializer_list<int64_t> shape) {
  bool ok = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t v : shape) ok = ok && t.shape[d++] == v;
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (int64_t v : shape) want += (d++ ? ", " : "") + std::to_string(v);
    bad(call, field, "has shape " + shape_str(t) + ", expected " + want + "]");
  }
}

// Elements of a bf16 / fp32 tensor as floats.
std::vector<float> floats_of(const char* call, const char* field, const Tensor& t, int64_t count,
                             const CopyOut& copy_out) {
  if (t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat32)
    bad(call, field, "has dtype " + std::string(dtype_name(t.dtype)) + ", expected bfloat16 or float32");
  require_packed(call, field, t);
  std::vector<float> out(count);
  if (t.dtype == DType::kFloat32) {
    copy_out(out.data(), t.data, count * 4);
  } else {
    std::vector<uint16_t> raw(count);
    copy_out(raw.data(), t.data, count * 2);
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_f32(raw[i]);
  }
  return out;
}

std::vector<float> norm_weight(const char* call, const char* field, const Tensor& t, int64_t dim,
                               const CopyOut& copy_out) {
  if (!t.defined()) bad(call, field, "is missing (null data pointer)");
  require_shape(call, field, t, {dim});
  return floats_of(call, field, t, dim, copy_out);
}

// A projection [rows, cols] (cols a multiple of 128) as a BlockMatrix of
// round_up(rows) rows: fp8 with its [ceil(rows/128), cols/128] scales copied,
// or bf16 / fp32 padded with zero rows and quantized.
BlockMatrix projection(const char* call, const char* field, const char* scale_field,
                       const Tensor& w, const Tensor& scale, int64_t rows, int64_t cols,
                       const CopyOut& copy_out) {
  if (!w.defined()) bad(call, field, "is missing (null data pointer)");
  require_shape(call, field, w, {rows, cols});
  require_packed(call, field, w);
  BlockMatrix m;
  m.rows = round_up(rows);
  m.cols = cols;
  m.q.assign(m.rows * cols, 0);
  m.scale.assign((m.rows / kBlock) * (cols / kBlock), 0.0f);
  if (w.dtype == DType::kFloat8E4M3 || w.dtype == DType::kUInt8) {
    if (!scale.defined()) bad(call, scale_field, "is missing: fp8 weights need their 128x128 block scales");
    if (scale.dtype != DType::kFloat32) bad(call, scale_field, "has dtype " + std::string(dtype_name(scale.dtype)) + ", expected float32");
    require_shape(call, scale_field, scale, {m.rows / kBlock, cols / kBlock});
    require_packed(call, scale_field, scale);
    copy_out(m.q.data(), w.data, rows * cols);
    copy_out(m.scale.data(), scale.data, m.scale.size() * 4);
    return m;
  }
  if (scale.defined())
    bad(call, scale_field, "must be absent for " + std::string(dtype_name(w.dtype)) +
                               " weights (they are quantized here)");
  std::vector<float> f = floats_of(call, field, w, rows * cols, copy_out);
  f.resize(m.rows * cols, 0.0f);
  layer::quantize_weight_blocks(f.data(), m.rows, cols, m.q.data(), m.scale.data());
  return m;
}

}  // namespace

BlockMatrix rows_of(const BlockMatrix& m, int64_t first, int64_t count) {
  BlockMatrix r;
  r.rows = count;
  r.cols = m.cols;
  r.q.assign(m.q.begin() + first * m.cols, m.q.begin() + (first + count) * m.cols);
  const int64_t sc = m.cols / kBlock;
  r.scale.assign(m.scale.begin() + first / kBlock * sc, m.scale.begin() + (first + count) / kBlock * sc);
  return r;
}

BlockMatrix cols_of(const BlockMatrix& m, int64_t first, int64_t count) {
  BlockMatrix r;
  r.rows = m.rows;
  r.cols = count;
  r.q.resize(m.rows * count);
  for (int64_t i = 0; i < m.rows; ++i)
    std::memcpy(&r.q[i * count], &m.q[i * m.cols + first], count);
  const int64_t sc = m.cols / kBlock, rc = count / kBlock;
  r.scale.resize((m.rows / kBlock) * rc);
  for (int64_t b = 0; b < m.rows / kBlock; ++b)
    for (int64_t c = 0; c < rc; ++c) r.scale[b * rc + c] = m.scale[b * sc + first / kBlock + c];
  return r;
}

BlockMatrix transposed(const BlockMatrix& m) {
  BlockMatrix r;
  r.rows = m.cols;
  r.cols = m.rows;
  r.q.resize(m.q.size());
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) r.q[j * m.rows + i] = m.q[i * m.cols + j];
  const int64_t br = m.rows / kBlock, bc = m.cols / kBlock;
  r.scale.resize(m.scale.size());
  for (int64_t i = 0; i < br; ++i)
    for (int64_t j = 0; j < bc; ++j) r.scale[j * br + i] = m.scale[i * bc + j];
  return r;
}

BlockMatrix stacked(const std::vector<const BlockMatrix*>& parts) {
  BlockMatrix r;
  r.cols = parts.front()->cols;
  for (const BlockMatrix* p : parts) {
    r.rows += p->rows;
    r.q.insert(r.q.end(), p->q.begin(), p->q.end());
    r.scale.insert(r.scale.end(), p->scale.begin(), p->scale.end());
  }
  return r;
}

HostMLAWeights prepare_mla_weights(const char* call, const MLAWeights& w, const MLAConfig& c,
                                   int tp_size, int tp_rank, const CopyOut& copy_out) {
  const int64_t D = c.hidden_size, heads = c.num_attention_heads, Hq = heads / tp_size,
                h0 = static_cast<int64_t>(tp_rank) * Hq, Rq = c.q_lora_rank, R = c.kv_lora_rank,
                Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim;
  HostMLAWeights h;
  if (w.input_layernorm.defined())
    h.input_layernorm = norm_weight(call, "input_layernorm", w.input_layernorm, D, copy_out);
  h.q_a_layernorm = norm_weight(call, "q_a_layernorm", w.q_a_layernorm, Rq, copy_out);
  h.kv_a_layernorm = norm_weight(call, "kv_a_layernorm", w.kv_a_layernorm, R, copy_out);
  const BlockMatrix q_a =
      projection(call, "q_a_proj", "q_a_proj_scale", w.q_a_proj, w.q_a_proj_scale, Rq, D, copy_out);
  const BlockMatrix kv_a = projection(call, "kv_a_proj_with_mqa", "kv_a_proj_with_mqa_scale",
                                      w.kv_a_proj_with_mqa, w.kv_a_proj_with_mqa_scale, R + Dr, D,
                                      copy_out);
  h.qkv_a = stacked({&q_a, &kv_a});
  const BlockMatrix q_b = projection(call, "q_b_proj", "q_b_proj_scale", w.q_b_proj,
                                     w.q_b_proj_scale, heads * (Dn + Dr), Rq, copy_out);
  h.q_b = rows_of(q_b, h0 * (Dn + Dr), Hq * (Dn + Dr));
  const BlockMatrix kv_b = projection(call, "kv_b_proj", "kv_b_proj_scale", w.kv_b_proj,
                                      w.kv_b_proj_scale, heads * (Dn + Dv), R, copy_out);
  h.kv_b = rows_of(kv_b, h0 * (Dn + Dv), Hq * (Dn + Dv));
  std::vector<BlockMatrix> uk(Hq), uv(Hq);
  std::vector<const BlockMatrix*> uk_parts, uv_parts;
  for (int64_t i = 0; i < Hq; ++i) {
    uk[i] = transposed(rows_of(h.kv_b, i * (Dn + Dv), Dn));
    uv[i] = rows_of(h.kv_b, i * (Dn + Dv) + Dn, Dv);
    uk_parts.push_back(&uk[i]);
    uv_parts.push_back(&uv[i]);
  }
  h.w_uk_t = stacked(uk_parts);
  h.w_uv = stacked(uv_parts);
  const BlockMatrix o =
      projection(call, "o_proj", "o_proj_scale", w.o_proj, w.o_proj_scale, D, heads * Dv, copy_out);
  h.o = cols_of(o, h0 * Dv, Hq * Dv);
  return h;
}

}  // namespace moelink::detail::attention
