// MLAAttention: argument checks, then one step composed from the fp8 GEMMs
// and quantization of Experts and the attention steps of AttentionOps:
//
//   [input_layernorm] -> quantize -> qkv_a GEMM -> q_a_layernorm -> quantize
//   -> q_b GEMM -> RoPE(q);   kv_a_layernorm + RoPE(k) -> AppendKV
//   decode rows:  q_nope per head -> W_UK^T batched GEMM (q in the latent
//                 space) -> attention on the latent cache -> W_UV batched
//                 GEMM -> per-token rows; the batched GEMMs in bf16 on
//                 cuBLAS (MLAHeadGemm::kBf16) or quantize -> fp8 grouped
//                 GEMM (kFp8)
//   prefill rows: per request, its cached latent in chunks -> quantize ->
//                 kv_b GEMM (per-head k_nope, v) -> MHA with running softmax
//   -> quantize -> o_proj GEMM -> out
#include <algorithm>
#include <cstring>
#include <vector>

#include "attention/attention_ops.h"
#include "attention/mla_checkpoint.h"
#include "attention/mla_weights.h"
#include "attention/rope.h"
#include "core/arg_checks.h"
#include "core/float_convert.h"
#include "moelink/attention.h"
#include "moelink/errors.h"
#include "moelink/experts.h"

namespace moelink {
namespace detail {

using attention::AttentionOps;
using attention::BlockMatrix;
using attention::RowPlan;
using attention::StepErrorRecord;

namespace {

constexpr int64_t kMaxTokens = 65536;
constexpr int64_t kBlock = 128;
// Keys of a prefill request folded in per chunk: bounds the kv_b expansion's
// buffer ([chunk, Hq (Dn + Dv)] bf16: 64 MiB at DeepSeek-V3's 128 heads).
constexpr int64_t kPrefillChunk = 1024;

using OpsBuffer = OwnedBuffer;

// A BlockMatrix in the ops' memory, with views as the GEMMs take them.
struct DeviceMatrix {
  OpsBuffer q, scale;
  int64_t groups = 1, rows = 0, cols = 0;  // groups x [rows, cols]
  void load(AttentionOps& ops, const BlockMatrix& m, int64_t g) {
    groups = g;
    rows = m.rows / g;
    cols = m.cols;
    q = OpsBuffer(ops, m.q.size());
    scale = OpsBuffer(ops, m.scale.size() * 4);
    ops.copy_in(q.as(), m.q.data(), m.q.size());
    ops.copy_in(scale.as(), m.scale.data(), m.scale.size() * 4);
  }
  Tensor w() const {
    return groups == 1 ? Tensor::contiguous(q.as(), DType::kFloat8E4M3, {rows, cols})
                       : Tensor::contiguous(q.as(), DType::kFloat8E4M3, {groups, rows, cols});
  }
  Tensor w_scale() const {
    return groups == 1 ? Tensor::contiguous(scale.as(), DType::kFloat32, {rows / kBlock, cols / kBlock})
                       : Tensor::contiguous(scale.as(), DType::kFloat32, {groups, rows / kBlock, cols / kBlock});
  }
};

// A stack of per-head matrices in bf16 ([groups x rows, cols] row-major),
// dequantized from their fp8 blocks: the head GEMMs of MLAHeadGemm::kBf16.
struct HeadMatrixBf16 {
  OpsBuffer w;
  void load(AttentionOps& ops, const attention::BlockMatrix& m) {
    std::vector<uint16_t> v(static_cast<size_t>(m.rows * m.cols));
    const int64_t blocks = m.cols / kBlock;
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = 0; c < m.cols; ++c)
        v[r * m.cols + c] =
            f32_to_bf16(e4m3_to_f32(m.q[r * m.cols + c]) * m.scale[(r / kBlock) * blocks + c / kBlock]);
    w = OpsBuffer(ops, v.size() * 2);
    ops.copy_in(w.as(), v.data(), v.size() * 2);
  }
  const uint16_t* data() const { return static_cast<const uint16_t*>(w.as()); }
};

std::string step_error_text(const StepErrorRecord& e) {
  using attention::StepError;
  const std::string req = std::to_string(e.request), v = std::to_string(e.value),
                    lim = std::to_string(e.limit);
  switch (static_cast<StepError>(e.code)) {
    case StepError::kQStart:
      return "q_start[" + req + "] = " + v + " is out of order or outside [0, " + lim +
             "] (q_start[0] = 0, non-decreasing, at most the rows of x); the whole step was skipped";
    case StepError::kDecodeLength:
      return "decode request " + req + " has " + v +
             " query tokens, at most 2 allowed (q_start); the whole step was skipped";
    case StepError::kKvLength:
      return "kv_len[" + req + "] = " + v + " is outside [its query tokens, the pages of its "
             "block-table row * page_size] (limit " + lim + "); request " + req + " was skipped";
    case StepError::kPageId:
      return "block_table[" + req + "][" + std::to_string(e.page) + "] = " + v +
             " is outside [0, " + lim + ") (the cache's pages); request " + req + " was skipped";
    default:
      return "unknown step error code " + std::to_string(e.code);
  }
}

}  // namespace

// What a forward() needs besides the layer's weights: the attention ops
// (FlashInfer's workspaces and plans inside), the GEMMs with their
// workspaces, the activations between the steps and the step's row plan.
// Nothing in it lives from one forward() to the next, so the layers of a
// model, which run one after another on one stream, share one (at
// DeepSeek-V3's 128 heads and 4096 tokens a step about 0.7 GB a layer).
struct MLAScratch {
  std::unique_ptr<AttentionOps> ops;  // allocates every buffer (so it goes last)
  std::unique_ptr<Experts> gemm, bmm;
  OwnedBuffer xn, xq, xs, qkv, qa, q, latent, attn, qn, hq, hs, qlat, olat, oh;
  OwnedBuffer chunk_latent, chunk_kpe, chunk_kv;
  OwnedBuffer plan_request, plan_position, plan_counts;
};

class MLAAttentionImpl {
 public:
  MLAAttentionImpl(const MLAConfig& config, const MLAOptions& options, const MLAAttentionImpl* share_with)
      : c_(config), o_(options) {
    c_.validate();
    const char* call = "MLAOptions";
    auto bad_option = [&](const char* field, int64_t v, const std::string& rule) {
      throw InvalidArgument(std::string("moelink: ") + call + "." + field + " = " +
                            std::to_string(v) + " " + rule);
    };
    if (o_.tp_size < 1 || c_.num_attention_heads % o_.tp_size != 0)
      bad_option("tp_size", o_.tp_size,
                 "must divide num_attention_heads = " + std::to_string(c_.num_attention_heads));
    if (o_.tp_rank < 0 || o_.tp_rank >= o_.tp_size)
      bad_option("tp_rank", o_.tp_rank, "must be in [0, tp_size = " + std::to_string(o_.tp_size) + ")");
    Hq_ = c_.num_attention_heads / o_.tp_size;
    if ((int64_t{Hq_} * c_.qk_head_dim()) % kBlock != 0)
      bad_option("tp_size", o_.tp_size,
                 "leaves " + std::to_string(Hq_) + " heads a rank, whose q_b_proj rows (" +
                     std::to_string(int64_t{Hq_} * c_.qk_head_dim()) +
                     ") are not a multiple of 128 (the fp8 weight blocks)");
    if (o_.page_size < 16 || o_.page_size % 16 != 0 || o_.page_size > 4096)
      bad_option("page_size", o_.page_size, "must be a multiple of 16 in [16, 4096]");
    if (o_.max_tokens < 1 || o_.max_tokens > kMaxTokens)
      bad_option("max_tokens", o_.max_tokens, "must be in [1, 65536]");
    if (o_.max_requests < 1 || o_.max_requests > kMaxTokens)
      bad_option("max_requests", o_.max_requests, "must be in [1, 65536]");
    if (o_.max_pages_per_request < 1 || o_.max_pages_per_request > (1 << 24))
      bad_option("max_pages_per_request", o_.max_pages_per_request, "must be in [1, 2^24]");
    if (o_.head_gemm != MLAHeadGemm::kBf16 && o_.head_gemm != MLAHeadGemm::kFp8)
      bad_option("head_gemm", static_cast<int>(o_.head_gemm), "must be MLAHeadGemm::kFp8 (0) or kBf16 (1)");
    debug_ = o_.debug >= 0 ? o_.debug != 0 : env_flag("MOELINK_DEBUG");
    const bool host = o_.device == AttentionDevice::kCPU;
    rope_ = attention::rope_params(c_);
    const int64_t T = o_.max_tokens, D = c_.hidden_size, Rq = c_.q_lora_rank, R = c_.kv_lora_rank,
                  Dn = c_.qk_nope_head_dim, Dr = c_.qk_rope_head_dim, Dv = c_.v_head_dim;
    Nqkv_ = Rq + (R + Dr + kBlock - 1) / kBlock * kBlock;
    Nd_ = std::min<int64_t>(T, 2 * int64_t{o_.max_requests});
    if (share_with != nullptr) {
      check_shareable(*share_with);
      s_ = share_with->s_;
    } else {
      s_ = std::make_shared<MLAScratch>();
      s_->ops = host ? attention::make_cpu_attention_ops()
                     : attention::make_cuda_attention_ops(c_, Hq_, o_);
      allocate_scratch(host, T, D, Rq, R, Dn, Dr, Dv);
    }
    AttentionOps& ops = *s_->ops;
    error_ = OpsBuffer(ops, sizeof(StepErrorRecord));
    inv_freq_ = OpsBuffer(ops, rope_.inv_freq.size() * 4);
    ops.copy_in(inv_freq_.as(), rope_.inv_freq.data(), rope_.inv_freq.size() * 4);
  }

  // share_with's scratch fits this layer: the same config and options.
  void check_shareable(const MLAAttentionImpl& o) const {
    auto same = [](const char* field, int64_t mine, int64_t theirs) {
      require_same_as_shared("MLAAttention.create", field, mine, theirs);
    };
    same("hidden_size", c_.hidden_size, o.c_.hidden_size);
    same("num_attention_heads", c_.num_attention_heads, o.c_.num_attention_heads);
    same("q_lora_rank", c_.q_lora_rank, o.c_.q_lora_rank);
    same("kv_lora_rank", c_.kv_lora_rank, o.c_.kv_lora_rank);
    same("qk_nope_head_dim", c_.qk_nope_head_dim, o.c_.qk_nope_head_dim);
    same("qk_rope_head_dim", c_.qk_rope_head_dim, o.c_.qk_rope_head_dim);
    same("v_head_dim", c_.v_head_dim, o.c_.v_head_dim);
    same("device", static_cast<int>(o_.device), static_cast<int>(o.o_.device));
    same("tp_size", o_.tp_size, o.o_.tp_size);
    same("page_size", o_.page_size, o.o_.page_size);
    same("max_tokens", o_.max_tokens, o.o_.max_tokens);
    same("max_requests", o_.max_requests, o.o_.max_requests);
    same("max_pages_per_request", o_.max_pages_per_request, o.o_.max_pages_per_request);
    same("decode_kernel", static_cast<int>(o_.decode_kernel), static_cast<int>(o.o_.decode_kernel));
    same("prefill_kernel", static_cast<int>(o_.prefill_kernel), static_cast<int>(o.o_.prefill_kernel));
    // (FlashMLA's decode, made for the first object's, needs the bf16 one.)
    same("head_gemm", static_cast<int>(o_.head_gemm), static_cast<int>(o.o_.head_gemm));
  }

  void allocate_scratch(bool host, int64_t T, int64_t D, int64_t Rq, int64_t R, int64_t Dn, int64_t Dr,
                        int64_t Dv) {
    ExpertConfig dense;  // quantize() and gemm() take any shapes
    dense.num_experts = 1;
    dense.max_rows = T;
    dense.hidden_dim = static_cast<int>(kBlock);
    dense.intermediate_dim = static_cast<int>(kBlock);
    dense.device = host ? ExpertDevice::kCPU : ExpertDevice::kCUDA;
    dense.debug = 0;
    s_->gemm = Experts::create(dense);
    ExpertConfig bmm = dense;  // the heads' batched GEMMs on the decode rows
    bmm.num_experts = Hq_;
    bmm.max_rows = Nd_;
    bmm.expected_rows = Nd_;
    s_->bmm = Experts::create(bmm);

    AttentionOps& ops = *s_->ops;
    const int64_t qcols = std::max({D, Rq, R, int64_t{Hq_} * Dv});
    s_->xn = OpsBuffer(ops, T * D * 2);
    s_->xq = OpsBuffer(ops, T * qcols);
    s_->xs = OpsBuffer(ops, T * (qcols / kBlock) * 4);
    s_->qkv = OpsBuffer(ops, T * Nqkv_ * 2);
    s_->qa = OpsBuffer(ops, T * Rq * 2);
    s_->q = OpsBuffer(ops, T * Hq_ * (Dn + Dr) * 2);
    s_->latent = OpsBuffer(ops, T * R * 2);
    s_->attn = OpsBuffer(ops, T * Hq_ * Dv * 2);
    s_->qn = OpsBuffer(ops, Hq_ * Nd_ * std::max(Dn, R) * 2);
    s_->hq = OpsBuffer(ops, Hq_ * Nd_ * std::max(Dn, R));
    s_->hs = OpsBuffer(ops, Hq_ * Nd_ * (std::max(Dn, R) / kBlock) * 4);
    s_->qlat = OpsBuffer(ops, Hq_ * Nd_ * (R + Dr) * 2);  // room for the roped dims (FlashMLA)
    s_->olat = OpsBuffer(ops, Hq_ * Nd_ * R * 2);
    s_->oh = OpsBuffer(ops, Hq_ * Nd_ * Dv * 2);
    s_->chunk_latent = OpsBuffer(ops, kPrefillChunk * R * 2);
    s_->chunk_kpe = OpsBuffer(ops, kPrefillChunk * Dr * 2);
    s_->chunk_kv = OpsBuffer(ops, kPrefillChunk * Hq_ * (Dn + Dv) * 2);
    s_->plan_request = OpsBuffer(ops, T * 4);
    s_->plan_position = OpsBuffer(ops, T * 4);
    s_->plan_counts = OpsBuffer(ops, (2 + Hq_) * 4);  // rows, a chunk's rows, decode rows per head
  }

  const MLAConfig& config() const { return c_; }
  const MLAOptions& options() const { return o_; }
  int local_heads() const { return Hq_; }

  void set_weights(const MLAWeights& w) {
    AttentionOps& ops = *s_->ops;
    const attention::HostMLAWeights h = attention::prepare_mla_weights(
        "MLAAttention.set_weights", w, c_, o_.tp_size, o_.tp_rank,
        [&](void* dst, const void* src, size_t bytes) { ops.copy_out(dst, src, bytes); });
    auto norm = [&](OpsBuffer& b, const std::vector<float>& v) {
      b = v.empty() ? OpsBuffer() : OpsBuffer(ops, v.size() * 4);
      if (!v.empty()) ops.copy_in(b.as(), v.data(), v.size() * 4);
    };
    norm(input_norm_, h.input_layernorm);
    norm(q_a_norm_, h.q_a_layernorm);
    norm(kv_a_norm_, h.kv_a_layernorm);
    qkv_a_.load(ops, h.qkv_a, 1);
    q_b_.load(ops, h.q_b, 1);
    kv_b_.load(ops, h.kv_b, 1);
    if (o_.head_gemm == MLAHeadGemm::kFp8) {
      w_uk_t_.load(ops, h.w_uk_t, Hq_);
      w_uv_.load(ops, h.w_uv, Hq_);
    } else {
      w_uk_t_bf16_.load(ops, h.w_uk_t);
      w_uv_bf16_.load(ops, h.w_uv);
    }
    o_proj_.load(ops, h.o, 1);
    has_weights_ = true;
  }

  void load_checkpoint(const std::string& directory, int layer_index) {
    if (layer_index < 0)
      throw InvalidArgument("moelink: MLAAttention.load_checkpoint: layer_index = " +
                            std::to_string(layer_index) + " must be >= 0");
    const attention::HostCheckpointTensors t = attention::read_mla_tensors(directory, layer_index);
    try {
      set_weights(t.weights);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string(e.what()) + " (layer " + std::to_string(layer_index) +
                            " of " + directory + ")");
    }
  }

  void forward(const Tensor& out, const Tensor& x, const MLABatch& b, const Tensor& cache,
               cudaStream_t stream) {
    const char* call = "MLAAttention.forward";
    if (!has_weights_)
      throw InvalidArgument("moelink: MLAAttention.forward: no weights yet (call set_weights or "
                            "load_checkpoint first)");
    const int64_t D = c_.hidden_size, Dn = c_.qk_nope_head_dim, Dr = c_.qk_rope_head_dim,
                  Dv = c_.v_head_dim, R = c_.kv_lora_rank, Rq = c_.q_lora_rank;
    const int64_t n = check_tensor(call, "x", x, {DType::kBFloat16}, {D}, true);
    if (n < 1 || n > o_.max_tokens)
      bad(call, "x", "has " + std::to_string(n) + " rows, expected 1.." + std::to_string(o_.max_tokens) + " (max_tokens)");
    if (check_tensor(call, "out", out, {DType::kBFloat16}, {D}, true) != n)
      bad(call, "out", "has shape " + shape_str(out) + ", expected [" + std::to_string(n) + ", " + std::to_string(D) + "] (x's rows)");
    const int64_t pages = check_cache(call, cache);
    const int max_pages = check_batch(call, b);
    if (b.num_requests == 0) return;

    AttentionOps& ops = *s_->ops;
    const RowPlan plan{s_->plan_request.as<int32_t>(), s_->plan_position.as<int32_t>(),
                       s_->plan_counts.as<int32_t>(), s_->plan_counts.as<int32_t>() + 2};
    const attention::StepBounds bounds{n, pages, max_pages, o_.page_size};
    ops.plan_step(b, n, bounds, Hq_, plan, error_.as<StepErrorRecord>(), stream);
    const Tensor rows = Tensor::contiguous(plan.rows, DType::kInt32, {1});

    // Projections: qkv_a, the norms, q_b.
    Tensor h = x;
    if (input_norm_.as()) {
      h = Tensor::contiguous(s_->xn.as(), DType::kBFloat16, {n, D});
      ops.rms_norm(h, x, input_norm_.as<float>(), eps(), plan.rows, stream);
    }
    const Tensor qkv = Tensor::contiguous(s_->qkv.as(), DType::kBFloat16, {n, Nqkv_});
    project(qkv, h, qkv_a_, rows, stream, /*scratch_y=*/true);
    const Tensor qa = Tensor::contiguous(s_->qa.as(), DType::kBFloat16, {n, Rq});
    ops.rms_norm(qa, columns(qkv, 0, Rq), q_a_norm_.as<float>(), eps(), plan.rows, stream);
    const Tensor q = Tensor::contiguous(s_->q.as(), DType::kBFloat16, {n, Hq_ * (Dn + Dr)});
    project(q, qa, q_b_, rows, stream);
    ops.rope_q(q, Hq_, static_cast<int>(Dn + Dr), static_cast<int>(Dr), plan,
               inv_freq_.as<float>(), rope_.attention_factor, c_.rope_interleave, stream);
    // The new tokens' cache rows.
    const Tensor latent = Tensor::contiguous(s_->latent.as(), DType::kBFloat16, {n, R});
    ops.rms_norm(latent, columns(qkv, Rq, R), kv_a_norm_.as<float>(), eps(), plan.rows, stream);
    ops.append_kv(cache, latent, columns(qkv, Rq + R, Dr), b, plan, inv_freq_.as<float>(),
                  rope_.attention_factor, c_.rope_interleave, stream);

    const Tensor attn = Tensor::contiguous(s_->attn.as(), DType::kBFloat16, {n, Hq_ * Dv});
    if (b.num_decode > 0) decode(attn, q, cache, b, plan, n, stream);
    if (b.num_decode < b.num_requests) prefill(attn, q, cache, b, bounds, stream);
    project(out, attn, o_proj_, rows, stream);
    if (debug_) check(stream);
  }

  void prepare_graph_replay(const MLABatch& batch, const Tensor& kv_cache) {
    if (batch.num_decode > 0) s_->ops->prepare_replay(batch, kv_cache);
  }

  void check(cudaStream_t stream) {
    // The GEMMs' row counts come from the checked plan: an error there is
    // moelink's own, reported first; the batch's is kept until then.
    s_->gemm->check(stream);
    s_->bmm->check(stream);
    const StepErrorRecord e = s_->ops->take_error(error_.as<StepErrorRecord>(), stream);
    if (e.code != 0)
      throw InputError("moelink: MLAAttention.forward: " + step_error_text(e));
  }

 private:
  float eps() const { return static_cast<float>(c_.rms_norm_eps); }

  // Columns [first, first + count) of a row-major matrix.
  static Tensor columns(const Tensor& t, int64_t first, int64_t count) {
    Tensor v = t;
    v.data = static_cast<char*>(t.data) + first * static_cast<int64_t>(dtype_size(t.dtype));
    v.shape[1] = count;
    return v;
  }

  // y [n, N] bf16 = quantize(x [n, K] bf16) . w^T for the rows < rows[0].
  // With `scratch_y` the GEMM may write y's rows past rows[0] too (from
  // stale activations: y is scratch, read only below rows[0]); called
  // without a row bound, a GEMM with few output tiles (qkv_a) runs split
  // over K in one kernel (Experts::gemm, docs/experts.md).
  void project(const Tensor& y, const Tensor& x, const DeviceMatrix& w, const Tensor& rows,
               cudaStream_t stream, bool scratch_y = false) {
    const int64_t n = x.shape[0], K = x.shape[1];
    const Tensor xq = Tensor::contiguous(s_->xq.as(), DType::kFloat8E4M3, {n, K});
    const Tensor xs = Tensor::contiguous(s_->xs.as(), DType::kFloat32, {n, K / kBlock});
    s_->gemm->quantize(xq, xs, x, rows, stream);
    s_->gemm->gemm(y, xq, xs, w.w(), w.w_scale(), scratch_y ? Tensor{} : rows, stream);
  }

  // y [Hq, Nd, N] = quantize(x [Hq, Nd, K]) . w[h]^T for the decode rows
  // (at most rows_bound a head: the GEMM's tiles).
  void project_heads(const Tensor& y, const Tensor& x, const DeviceMatrix& w, const int32_t* counts,
                     int64_t rows_bound, cudaStream_t stream) {
    const int64_t K = x.shape[2];
    const Tensor xq = Tensor::contiguous(s_->hq.as(), DType::kFloat8E4M3, {Hq_, Nd_, K});
    const Tensor xs = Tensor::contiguous(s_->hs.as(), DType::kFloat32, {Hq_, Nd_, K / kBlock});
    s_->gemm->quantize(Tensor::contiguous(xq.data, DType::kFloat8E4M3, {Hq_ * Nd_, K}),
                    Tensor::contiguous(xs.data, DType::kFloat32, {Hq_ * Nd_, K / kBlock}),
                    Tensor::contiguous(x.data, DType::kBFloat16, {Hq_ * Nd_, K}), {}, stream);
    s_->bmm->grouped_gemm(y, Tensor::contiguous(const_cast<int32_t*>(counts), DType::kInt32, {Hq_}),
                       xq, xs, w.w(), w.w_scale(), stream, std::max<int64_t>(rows_bound, 1));
  }

  void decode(const Tensor& attn, const Tensor& q, const Tensor& cache, const MLABatch& b,
              const RowPlan& plan, int64_t x_rows, cudaStream_t stream) {
    const int64_t Dn = c_.qk_nope_head_dim, Dr = c_.qk_rope_head_dim, R = c_.kv_lora_rank,
                  Dv = c_.v_head_dim;
    AttentionOps& ops = *s_->ops;
    // q_nope into the latent space: [Hq, Nd, Dn] -> [Hq, Nd, R].
    const Tensor qn = Tensor::contiguous(s_->qn.as(), DType::kBFloat16, {Hq_, Nd_, Dn});
    ops.split_heads(qn, q, Hq_, Dn + Dr, 0, plan.decode_rows, stream);
    // The latent queries, each row followed by its roped dims where the
    // decode kernel reads the two as one vector (FlashMLA's).
    const bool with_rope = o_.head_gemm == MLAHeadGemm::kBf16 && ops.decode_query_with_rope(b, stream);
    const int64_t qlat_row = with_rope ? R + Dr : R;
    Tensor qlat = Tensor::contiguous(s_->qlat.as(), DType::kBFloat16, {Hq_, Nd_, R});
    qlat.stride[0] = Nd_ * qlat_row, qlat.stride[1] = qlat_row;
    // The host's bound on the decode rows (q_len 1 or 2 a request).
    const int64_t rows_bound = std::min<int64_t>({x_rows, 2 * int64_t{b.num_decode}, Nd_});
    if (o_.head_gemm == MLAHeadGemm::kFp8)
      project_heads(qlat, qn, w_uk_t_, plan.decode_rows, rows_bound, stream);
    else
      ops.head_gemm(qlat, qn, w_uk_t_bf16_.data(), rows_bound, plan.decode_rows, stream);
    if (with_rope) {
      Tensor pe = Tensor::contiguous(static_cast<uint16_t*>(s_->qlat.as()) + R, DType::kBFloat16, {Hq_, Nd_, Dr});
      pe.stride[0] = qlat.stride[0], pe.stride[1] = qlat.stride[1];
      ops.split_heads(pe, q, Hq_, Dn + Dr, Dn, plan.decode_rows, stream);
    }
    const Tensor olat = Tensor::contiguous(s_->olat.as(), DType::kBFloat16, {Hq_, Nd_, R});
    ops.decode_attention(olat, qlat, q, cache, b, plan, Hq_, static_cast<int>(Dn),
                         static_cast<float>(c_.softmax_scale()), stream);
    // The latent output through W_UV: [Hq, Nd, R] -> [Hq, Nd, Dv] -> rows.
    const Tensor oh = Tensor::contiguous(s_->oh.as(), DType::kBFloat16, {Hq_, Nd_, Dv});
    if (o_.head_gemm == MLAHeadGemm::kFp8)
      project_heads(oh, olat, w_uv_, plan.decode_rows, rows_bound, stream);
    else
      ops.head_gemm(oh, olat, w_uv_bf16_.data(), rows_bound, plan.decode_rows, stream);
    ops.merge_heads(attn, oh, Hq_, plan.decode_rows, stream);
  }

  // The prefill chunks, one request at a time (eager: the host reads the
  // batch's values to size each request's loop).
  void prefill(const Tensor& attn, const Tensor& q, const Tensor& cache, const MLABatch& b,
               const attention::StepBounds& bounds, cudaStream_t stream) {
    const int64_t Dn = c_.qk_nope_head_dim, Dr = c_.qk_rope_head_dim, R = c_.kv_lora_rank,
                  Dv = c_.v_head_dim, B = b.num_requests;
    AttentionOps& ops = *s_->ops;
    std::vector<int32_t> q_start(B + 1), kv_len(B), block_row(bounds.max_pages);
    ops.sync(stream);  // the batch's values may come from work on the stream
    ops.copy_out(q_start.data(), b.q_start.data, (B + 1) * 4);
    ops.copy_out(kv_len.data(), b.kv_len.data, B * 4);
    StepErrorRecord scratch{};  // plan_step has recorded the failures already
    if (attention::step_rows(q_start.data(), b.num_requests, b.num_decode, bounds.rows, &scratch) == 0)
      return;
    int32_t* chunk_rows = s_->plan_counts.as<int32_t>() + 1;
    for (int i = b.num_decode; i < b.num_requests; ++i) {
      const int64_t row0 = q_start[i], q_rows = q_start[i + 1] - q_start[i];
      if (q_rows == 0) continue;
      ops.copy_out(block_row.data(),
                   static_cast<const int32_t*>(b.block_table.data) + i * b.block_table.stride[0],
                   bounds.max_pages * 4);
      if (!attention::request_ok(i, q_start.data(), kv_len.data(), block_row.data(), bounds, &scratch)) {
        ops.zero_rows(attn, row0, q_rows, stream);
        continue;
      }
      const int64_t len = kv_len[i];
      auto state = ops.prefill_begin(q_rows, Hq_, static_cast<int>(Dv), stream);
      const int32_t* block_row_dev = static_cast<const int32_t*>(b.block_table.data) + i * b.block_table.stride[0];
      for (int64_t k0 = 0; k0 < len; k0 += kPrefillChunk) {
        const int64_t count = std::min(kPrefillChunk, len - k0);
        ops.set_count(chunk_rows, static_cast<int32_t>(count), stream);
        const Tensor lat = Tensor::contiguous(s_->chunk_latent.as(), DType::kBFloat16, {count, R});
        const Tensor kpe = Tensor::contiguous(s_->chunk_kpe.as(), DType::kBFloat16, {count, Dr});
        ops.gather_kv(lat, kpe, cache, block_row_dev, o_.page_size, k0, count, stream);
        const Tensor kv = Tensor::contiguous(s_->chunk_kv.as(), DType::kBFloat16, {count, Hq_ * (Dn + Dv)});
        project(kv, lat, kv_b_, Tensor::contiguous(chunk_rows, DType::kInt32, {1}), stream);
        ops.prefill_chunk(*state, q, row0, q_rows, len - q_rows, kv, kpe, k0, Hq_,
                          static_cast<int>(Dn), static_cast<int>(Dr), static_cast<int>(Dv),
                          static_cast<float>(c_.softmax_scale()), stream);
      }
      ops.prefill_finish(*state, attn, row0, stream);
    }
  }

  int64_t check_cache(const char* call, const Tensor& cache) const {
    const int64_t Dc = c_.cache_row();
    if (check_tensor(call, "kv_cache", cache, {DType::kBFloat16}, {o_.page_size, Dc}, true) < 1 ||
        cache.ndim != 3 || cache.stride[1] != Dc || cache.stride[0] != o_.page_size * Dc)
      bad(call, "kv_cache", "has shape " + shape_str(cache) + ", expected a contiguous [num_pages >= 1, " +
                                std::to_string(o_.page_size) + ", " + std::to_string(Dc) +
                                "] (page_size, kv_lora_rank + qk_rope_head_dim)");
    return cache.shape[0];
  }

  // Returns the block table's columns.
  int check_batch(const char* call, const MLABatch& b) const {
    if (b.num_requests < 0 || b.num_requests > o_.max_requests)
      bad(call, "batch.num_requests", "= " + std::to_string(b.num_requests) + " must be in [0, " +
                                          std::to_string(o_.max_requests) + "] (max_requests)");
    if (b.num_decode < 0 || b.num_decode > b.num_requests)
      bad(call, "batch.num_decode", "= " + std::to_string(b.num_decode) + " must be in [0, " +
                                        std::to_string(b.num_requests) + "] (num_requests)");
    if (b.plan_slot < 0 || b.plan_slot >= kMLAPlanSlots)
      bad(call, "batch.plan_slot", "= " + std::to_string(b.plan_slot) + " must be in [0, " +
                                       std::to_string(kMLAPlanSlots) + ")");
    const int64_t B = b.num_requests;
    auto vector_of = [&](const char* field, const Tensor& t, int64_t len) {
      if (!t.defined()) bad(call, field, "is missing (null data pointer)");
      if (t.ndim != 1 || t.shape[0] != len || t.dtype != DType::kInt32 || (len > 1 && t.stride[0] != 1))
        bad(call, field, "must be a contiguous int32 tensor of shape [" + std::to_string(len) +
                             "], got dtype " + std::string(dtype_name(t.dtype)) + " shape " + shape_str(t));
    };
    vector_of("batch.q_start", b.q_start, B + 1);
    if (B == 0) return 0;
    vector_of("batch.kv_len", b.kv_len, B);
    const Tensor& bt = b.block_table;
    if (!bt.defined()) bad(call, "batch.block_table", "is missing (null data pointer)");
    if (bt.ndim != 2 || bt.shape[0] != B || bt.dtype != DType::kInt32 || bt.shape[1] < 1 ||
        bt.shape[1] > o_.max_pages_per_request || (bt.shape[1] > 1 && bt.stride[1] != 1) ||
        (bt.shape[0] > 1 && bt.stride[0] < bt.shape[1]))
      bad(call, "batch.block_table",
          "must be an int32 tensor [" + std::to_string(B) + ", 1.." +
              std::to_string(o_.max_pages_per_request) +
              "] (max_pages_per_request) with contiguous rows, got dtype " +
              std::string(dtype_name(bt.dtype)) + " shape " + shape_str(bt));
    // The optional host copies: all three or none, the device tensors' shapes.
    if (b.host_q_start.defined() || b.host_kv_len.defined() || b.host_block_table.defined()) {
      vector_of("batch.host_q_start", b.host_q_start, B + 1);
      vector_of("batch.host_kv_len", b.host_kv_len, B);
      const Tensor& h = b.host_block_table;
      if (!h.defined() || h.ndim != 2 || h.shape[0] != B || h.shape[1] != bt.shape[1] ||
          h.dtype != DType::kInt32 || (h.shape[1] > 1 && h.stride[1] != 1) ||
          (h.shape[0] > 1 && h.stride[0] < h.shape[1]))
        bad(call, "batch.host_block_table",
            "must come with host_q_start and host_kv_len as an int32 tensor of block_table's shape " +
                shape_str(bt) + " with contiguous rows, got " +
                (h.defined() ? "dtype " + std::string(dtype_name(h.dtype)) + " shape " + shape_str(h)
                             : std::string("none")));
    }
    return static_cast<int>(bt.shape[1]);
  }

  MLAConfig c_;
  MLAOptions o_;
  int Hq_ = 0;
  int64_t Nqkv_ = 0, Nd_ = 0;
  bool debug_ = false, has_weights_ = false;
  attention::RopeParams rope_;
  // Perhaps shared with other layers (MLAAttention::create's share_with);
  // its ops allocated the buffers below, so it goes after them.
  std::shared_ptr<MLAScratch> s_;
  OpsBuffer error_, inv_freq_;
  OpsBuffer input_norm_, q_a_norm_, kv_a_norm_;
  DeviceMatrix qkv_a_, q_b_, kv_b_, w_uk_t_, w_uv_, o_proj_;  // w_uk_t_, w_uv_: MLAHeadGemm::kFp8
  HeadMatrixBf16 w_uk_t_bf16_, w_uv_bf16_;                    // MLAHeadGemm::kBf16
};

}  // namespace detail

std::unique_ptr<MLAAttention> MLAAttention::create(const MLAConfig& config, const MLAOptions& options,
                                                   const MLAAttention* share_with) {
  return std::unique_ptr<MLAAttention>(new MLAAttention(std::make_unique<detail::MLAAttentionImpl>(
      config, options, share_with != nullptr ? share_with->impl_.get() : nullptr)));
}

MLAAttention::MLAAttention(std::unique_ptr<detail::MLAAttentionImpl> impl) : impl_(std::move(impl)) {}
MLAAttention::~MLAAttention() = default;
const MLAConfig& MLAAttention::config() const { return impl_->config(); }
const MLAOptions& MLAAttention::options() const { return impl_->options(); }
int MLAAttention::local_heads() const { return impl_->local_heads(); }
void MLAAttention::set_weights(const MLAWeights& w) { impl_->set_weights(w); }
void MLAAttention::load_checkpoint(const std::string& directory, int layer_index) {
  impl_->load_checkpoint(directory, layer_index);
}
void MLAAttention::forward(const Tensor& out, const Tensor& x, const MLABatch& batch,
                           const Tensor& kv_cache, cudaStream_t stream) {
  impl_->forward(out, x, batch, kv_cache, stream);
}
void MLAAttention::check(cudaStream_t stream) { impl_->check(stream); }
void MLAAttention::prepare_graph_replay(const MLABatch& batch, const Tensor& kv_cache) {
  impl_->prepare_graph_replay(batch, kv_cache);
}

}  // namespace moelink
