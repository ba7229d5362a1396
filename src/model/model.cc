// Model: the step over every layer, composed from MLAAttention, MoELayer or
// the dense MLP (an Experts of one expert) and ModelOps:
//
//   h = embed(token_ids)
//   per layer:  a = attention(h)                 (its input_layernorm inside)
//               h += a; hn = post_attention_layernorm(h)
//               m = dense_mlp(hn) | moe(hn);  h += m (in the next layer's
//               add_rms_norm, or the final norm's)
//   logits = lm_head(norm(h)) of the rows sampled; next tokens sampled,
//            drafts verified (draft_rules.h)
//   MTP (ModelOptions.mtp): x = eh_proj([enorm(embed(token after each
//            row)), hnorm(norm(h))]); x through the MTP decoder layer;
//            draft = argmax shared_head(shared_head.norm(x)) of the row
//            after the last accepted token
//
// Every rank runs every MoE layer's collective calls, also with no tokens
// (a one-row view with m = 0), in the same mode: the MoE layers get
// num_tokens = max_tokens, so their mode follows it, not the rank's batch.
//
// In micro-batch mode the MoE layers run the step's requests as two
// micro-batches interleaved across attention and MoE (seed article 002's
// five-stage pipeline): micro-batch a's dispatch travels while b's
// attention runs, a's combine while b's experts run, b's combine while a's
// next attention runs (two_batch_layers). A rank whose step cannot split
// (q_start not on the host, a half too large for its AllToAll) runs each
// MoE layer's forward(), which micro-batches on the same two AllToAlls. A
// decode graph splits its bucket at nb / 2 (step_in_graph places the
// requests so that both halves carry some); the second micro-batch's rows
// move into buffers of their own, since a replay's rows start elsewhere.
#include "moelink/model.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>
#include <vector>

#include "core/arg_checks.h"
#include "core/error_collector.h"
#include "core/float_convert.h"
#include "core/tensor_views.h"
#include "layer/checkpoint.h"
#include "layer/safetensors.h"
#include "model/draft_rules.h"
#include "model/model_ops.h"
#include "moelink/errors.h"
#include "moelink/experts.h"

namespace moelink {

namespace {

[[noreturn]] void bad_field(const char* field, int64_t value, const std::string& rule) {
  throw InvalidArgument(std::string("moelink: ModelConfig.") + field + " = " + std::to_string(value) +
                        " " + rule);
}

}  // namespace

ModelConfig ModelConfig::deepseek_v3() {
  ModelConfig c;
  c.attention = MLAConfig::deepseek_v3();
  c.moe = MoEModelConfig::deepseek_v3();
  c.vocab_size = 129280;
  c.num_hidden_layers = 61;
  c.first_k_dense_replace = 3;
  c.intermediate_size = 18432;
  c.num_nextn_predict_layers = 1;
  return c;
}

ModelConfig ModelConfig::kimi_k2() {
  ModelConfig c;
  c.attention = MLAConfig::kimi_k2();
  c.moe = MoEModelConfig::kimi_k2();
  c.vocab_size = 163840;
  c.num_hidden_layers = 61;
  c.first_k_dense_replace = 1;
  c.intermediate_size = 18432;
  return c;
}

ModelConfig ModelConfig::preset(const std::string& name) {
  if (name == "deepseek-v3" || name == "deepseek-r1") return deepseek_v3();
  if (name == "kimi-k2") return kimi_k2();
  throw InvalidArgument("moelink: ModelConfig.preset: '" + name +
                        "' is not a preset (deepseek-v3, deepseek-r1, kimi-k2)");
}

void ModelConfig::validate() const {
  attention.validate();
  moe.validate();
  if (moe.hidden_size != attention.hidden_size)
    bad_field("moe.hidden_size", moe.hidden_size,
              "must equal attention.hidden_size = " + std::to_string(attention.hidden_size));
  if (vocab_size < 1 || vocab_size > (1 << 24)) bad_field("vocab_size", vocab_size, "must be in [1, 2^24]");
  if (num_hidden_layers < 1 || num_hidden_layers > 4096)
    bad_field("num_hidden_layers", num_hidden_layers, "must be in [1, 4096]");
  if (first_k_dense_replace < 0 || first_k_dense_replace > num_hidden_layers)
    bad_field("first_k_dense_replace", first_k_dense_replace,
              "must be in [0, num_hidden_layers = " + std::to_string(num_hidden_layers) + "]");
  if (first_k_dense_replace > 0 && (intermediate_size < 128 || intermediate_size % 128 != 0))
    bad_field("intermediate_size", intermediate_size, "must be a positive multiple of 128 (the dense MLP)");
  if (!(rms_norm_eps > 0.0)) bad_field("rms_norm_eps", static_cast<int64_t>(rms_norm_eps), "must be > 0");
}

namespace detail {

using model::ModelErrorRecord;
using model::ModelOps;
using model::kMaxDrafts;
using model::kSampleSlots;

namespace {

using ModelBuffer = OwnedBuffer;

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
  return b;
}

// The dense MLP of the first layers: an Experts of one expert whose row
// count is the step's rows (as the MoE layer's shared expert).
struct DenseMlp {
  std::shared_ptr<Experts> experts;  // the kernels and workspace, one for every dense layer
  ModelBuffer w13, w13_scale, w2, w2_scale;
};

}  // namespace

class ModelImpl {
 public:
  ModelImpl(const ModelConfig& config, const ModelOptions& options, Bootstrap& boot)
      : c_(config), o_(options) {
    c_.validate();
    if (o_.num_layers < 0 || o_.num_layers > c_.num_hidden_layers)
      throw InvalidArgument("moelink: ModelOptions.num_layers = " + std::to_string(o_.num_layers) +
                            " must be in [0, num_hidden_layers = " +
                            std::to_string(c_.num_hidden_layers) + "] (0: all)");
    layers_ = o_.num_layers > 0 ? o_.num_layers : c_.num_hidden_layers;
    if (o_.num_pages < 1)
      throw InvalidArgument("moelink: ModelOptions.num_pages = " + std::to_string(o_.num_pages) +
                            " must be >= 1 (the KV cache's pages per layer)");
    host_ = backend_uses_host_memory(o_.moe.all_to_all.backend);
    ops_ = host_ ? model::make_cpu_model_ops() : model::make_cuda_model_ops();
    const int64_t T = o_.moe.max_tokens, D = c_.attention.hidden_size, V = c_.vocab_size;
    MLAOptions ao = o_.attention;
    ao.device = host_ ? AttentionDevice::kCPU : AttentionDevice::kCUDA;
    ao.max_tokens = T;
    if (o_.mtp && c_.num_nextn_predict_layers < 1)
      throw InvalidArgument("moelink: ModelOptions.mtp needs an MTP module, but ModelConfig."
                            "num_nextn_predict_layers = " + std::to_string(c_.num_nextn_predict_layers));
    // The MTP module's decoder layer (a MoE layer: it follows the dense
    // ones) sits after the layers run, with a KV cache of its own.
    // Every layer's KV cache in one region, layer after layer (one
    // registration moves a request's pages of all of them: P/D hand-off).
    const int caches = layers_ + (o_.mtp ? 1 : 0);
    cache_bytes_ = o_.num_pages * ao.page_size * c_.attention.cache_row() * 2;
    kv_region_ = ModelBuffer(*ops_, static_cast<size_t>(cache_bytes_ * caches));
    // The layers run one after another: the attentions share the first's
    // scratch, the dense MLPs one Experts (kernels and workspace), the MoE
    // layers the first's AllToAlls, expert kernels and workspaces.
    std::shared_ptr<Experts> dense_experts;
    const MoELayer* first_moe = nullptr;
    for (int l = 0; l < caches; ++l) {
      Layer layer;
      // Every layer's attention on the first's scratch (MLAAttention::create's share_with).
      layer.attention = MLAAttention::create(c_.attention, ao, l > 0 ? layers_v_[0].attention.get() : nullptr);
      layer.post_norm = ModelBuffer(*ops_, D * 4);
      if (l < c_.first_k_dense_replace && l < layers_) {
        ExpertConfig ec;
        ec.num_experts = 1;
        ec.max_rows = T;
        ec.hidden_dim = static_cast<int>(D);
        ec.intermediate_dim = c_.intermediate_size;
        ec.expected_rows = T;
        ec.device = host_ ? ExpertDevice::kCPU : ExpertDevice::kCUDA;
        if (!dense_experts) dense_experts = Experts::create(ec);
        layer.dense = std::make_unique<DenseMlp>();
        layer.dense->experts = dense_experts;
      } else {
        layer.moe = MoELayer::create(c_.moe, o_.moe, boot, first_moe);
        if (first_moe == nullptr) first_moe = layer.moe.get();
      }
      layers_v_.push_back(std::move(layer));
    }
    // The residual stream, the normed input of each MLP, each part's
    // output, quantized activations of the dense MLP, logits.
    const int64_t rows = std::max<int64_t>(T, 1);
    h_ = ModelBuffer(*ops_, rows * D * 2);
    normed_ = ModelBuffer(*ops_, rows * D * 2);
    part_ = ModelBuffer(*ops_, rows * D * 2);
    xq_ = ModelBuffer(*ops_, rows * D);
    xs_ = ModelBuffer(*ops_, rows * (D / 128) * 4);
    const int64_t slots = static_cast<int64_t>(ao.max_requests) * kSampleSlots;
    sample_logits_ = ModelBuffer(*ops_, static_cast<size_t>(slots) * V * 4);
    sample_rows_ = ModelBuffer(*ops_, slots * 4);
    sample_pos_ = ModelBuffer(*ops_, slots * 4);
    samples_ = ModelBuffer(*ops_, slots * 4);
    last_rows_ = ModelBuffer(*ops_, slots * 4);
    if (o_.mtp) {
      mtp_ = std::make_unique<Mtp>();
      mtp_->enorm = ModelBuffer(*ops_, D * 4);
      mtp_->hnorm = ModelBuffer(*ops_, D * 4);
      mtp_->shared_norm = ModelBuffer(*ops_, D * 4);
      mtp_->joined = ModelBuffer(*ops_, rows * 2 * D * 2);
      mtp_->tokens = ModelBuffer(*ops_, rows * 4);
      mtp_->draft_row = ModelBuffer(*ops_, static_cast<size_t>(ao.max_requests) * 4);
      mtp_->drafts = ModelBuffer(*ops_, static_cast<size_t>(ao.max_requests) * 4);
      mtp_->logits = ModelBuffer(*ops_, static_cast<size_t>(ao.max_requests) * V * 4);
    }
    error_ = ModelBuffer(*ops_, sizeof(ModelErrorRecord));
    zero_ = ModelBuffer(*ops_, 4);
    rows_ = ModelBuffer(*ops_, 4);
    two_q_start_ = ModelBuffer(*ops_, (static_cast<size_t>(ao.max_requests) + 1) * 4);
    two_rows_ = ModelBuffer(*ops_, 2 * 4);
    // The second micro-batch's residual rows and scratch (floor(T / 2) rows).
    const size_t second = static_cast<size_t>(std::max<int64_t>(T / 2, 1)) * D * 2;
    two_h_ = ModelBuffer(*ops_, second);
    two_normed_ = ModelBuffer(*ops_, second);
    two_part_ = ModelBuffer(*ops_, second);
    final_norm_ = ModelBuffer(*ops_, D * 4);
    ExpertConfig qc;  // quantize() takes any shapes
    qc.num_experts = 1;
    qc.max_rows = rows;
    qc.hidden_dim = 128;
    qc.intermediate_dim = 128;
    qc.device = host_ ? ExpertDevice::kCPU : ExpertDevice::kCUDA;
    quant_ = Experts::create(qc);
  }

  const ModelConfig& config() const { return c_; }
  int num_layers() const { return layers_; }
  bool mtp() const { return mtp_ != nullptr; }
  const DecodeGraphStats& decode_graph_stats() const { return graph_stats_; }
  int64_t two_batch_steps() const { return two_batch_steps_; }

  void load_checkpoint(const std::string& directory) {
    const char* call = "Model.load_checkpoint";
    const layer::SafetensorsDir dir(directory);
    const int64_t D = c_.attention.hidden_size, V = c_.vocab_size;
    auto bf16_matrix = [&](const std::string& name, std::vector<int64_t> shape = {}) {
      if (shape.empty()) shape = {V, D};
      const std::vector<uint16_t> b = to_bf16(layer::read_float_tensor(dir, name, shape, call));
      ModelBuffer m(*ops_, b.size() * 2);
      ops_->copy_in(m.as(), b.data(), b.size() * 2);
      return m;
    };
    auto vector = [&](const std::string& name, ModelBuffer& dst) {
      const std::vector<float> v = layer::read_float_tensor(dir, name, {D}, call);
      ops_->copy_in(dst.as(), v.data(), v.size() * 4);
    };
    embed_ = bf16_matrix("model.embed_tokens.weight");
    lm_head_ = c_.tie_word_embeddings ? bf16_matrix("model.embed_tokens.weight") : bf16_matrix("lm_head.weight");
    vector("model.norm.weight", final_norm_);
    for (int l = 0; l < static_cast<int>(layers_v_.size()); ++l) {
      Layer& layer = layers_v_[l];
      // The MTP module's weights follow the model's last layer's index.
      const int index = l < layers_ ? l : c_.num_hidden_layers;
      const std::string prefix = "model.layers." + std::to_string(index) + ".";
      if (l == layers_) {
        // DeepSeek-V3 ships the embedding again in the module
        // (embed_tokens): the same table as the model's, which it uses.
        vector(prefix + "enorm.weight", mtp_->enorm);
        vector(prefix + "hnorm.weight", mtp_->hnorm);
        vector(prefix + "shared_head.norm.weight", mtp_->shared_norm);
        mtp_->eh_proj = bf16_matrix(prefix + "eh_proj.weight", {D, 2 * D});
        mtp_->head = bf16_matrix(prefix + "shared_head.head.weight");
      }
      layer.attention->load_checkpoint(directory, index);
      vector(prefix + "post_attention_layernorm.weight", layer.post_norm);
      if (layer.moe) {
        layer.moe->load_checkpoint(directory, index);
        continue;
      }
      const layer::HostMlpWeights w =
          layer::read_mlp_weights(dir, prefix + "mlp.", c_.intermediate_size, D, call);
      DenseMlp& m = *layer.dense;
      auto copy = [&](ModelBuffer& dst, const void* src, size_t bytes) {
        dst = ModelBuffer(*ops_, bytes);
        ops_->copy_in(dst.as(), src, bytes);
      };
      copy(m.w13, w.w13.data(), w.w13.size());
      copy(m.w13_scale, w.w13_scale.data(), w.w13_scale.size() * 4);
      copy(m.w2, w.w2.data(), w.w2.size());
      copy(m.w2_scale, w.w2_scale.data(), w.w2_scale.size() * 4);
    }
    has_weights_ = true;
  }

  Tensor kv_cache_region() const {
    return Tensor::contiguous(kv_region_.as(), DType::kUInt8, {cache_bytes_ * static_cast<int64_t>(layers_v_.size())});
  }

  Tensor kv_cache(int l) const {
    const int caches = static_cast<int>(layers_v_.size());
    if (l < 0 || l >= caches)
      throw InvalidArgument("moelink: Model.kv_cache: layer = " + std::to_string(l) + " must be in [0, " +
                            std::to_string(caches) + ")" + (mtp_ ? " (the last: the MTP module's)" : ""));
    return Tensor::contiguous(kv_region_.as<uint8_t>() + l * cache_bytes_, DType::kBFloat16,
                              {o_.num_pages, o_.attention.page_size, c_.attention.cache_row()});
  }

  void step(const StepInput& in, const StepOutput& out, cudaStream_t stream) {
    const char* call = "Model.step";
    if (!has_weights_)
      throw InvalidArgument("moelink: Model.step: no weights yet (call load_checkpoint first)");
    const int64_t D = c_.attention.hidden_size, V = c_.vocab_size, T = o_.moe.max_tokens;
    const int B = in.batch.num_requests;
    // A rank without requests may pass no tokens at all (it still takes
    // part in the MoE layers' exchanges).
    const int64_t n = B == 0 && !in.token_ids.defined()
                          ? 0
                          : check_tensor(call, "token_ids", in.token_ids, {DType::kInt32}, {}, false);
    if (n > T) bad(call, "token_ids", "has " + std::to_string(n) + " rows, more than max_tokens = " + std::to_string(T));
    if (B < 0 || B > o_.attention.max_requests)
      bad(call, "batch.num_requests", "= " + std::to_string(B) + " must be in [0, " +
                                          std::to_string(o_.attention.max_requests) + "] (max_requests)");
    check_outputs(call, out, n, B, V);
    check_step_vectors(call, in, out, B, V);
    check_sampling(call, in.sampling, B);
    // Rows of this rank's step: q_start[B], read where the step runs and
    // kept within the rows of token_ids (0 without requests: the MoE layers
    // still take part in their collectives).
    int32_t* rows = rows_.as<int32_t>();
    if (B > 0)
      ops_->step_rows(static_cast<const int32_t*>(in.batch.q_start.data), B, n, rows, stream);
    else
      ops_->copy_async(rows, zero_.as(), 4, stream);
    const Tensor bound = Tensor::contiguous(rows, DType::kInt32, {1});
    const int64_t nr = std::max<int64_t>(n, 1);  // the MoE layers take at least one row
    const Tensor h = Tensor::contiguous(h_.as(), DType::kBFloat16, {nr, D});
    const Tensor normed = Tensor::contiguous(normed_.as(), DType::kBFloat16, {nr, D});
    const Tensor part = Tensor::contiguous(part_.as(), DType::kBFloat16, {nr, D});
    ModelOps& ops = *ops_;
    auto* error = error_.as<ModelErrorRecord>();
    if (n > 0) ops.embed(h, in.token_ids, embed_.as<uint16_t>(), V, rows, error, stream);
    MicroBatch mb[2];
    const int split_at = split_two(in.batch, n, mb, stream) ? first_moe_layer() : layers_;
    for (int l = 0; l < split_at; ++l)
      decoder_layer(layers_v_[l], l, h, normed, part, in.batch, n, rows, bound, stream);
    if (split_at < layers_) {
      two_batch_layers(mb, split_at, stream);
      if (!capturing_) ++two_batch_steps_;  // a capture runs nothing: its replays count
    }
    ops.add_rms_norm(h, Tensor{}, normed, final_norm_.as<float>(), eps(), rows, stream);
    if (B > 0) sample_and_verify(in, out, normed, rows, stream);
    if (mtp_) mtp_step(in, out, h, normed, part, n, rows, bound, stream);
  }

  void step_from_host(const StepInput& in, const StepOutput& out, cudaStream_t stream) {
    if (host_) return step(in, out, stream);
    if (o_.decode_graphs && graphable(in, out)) return step_in_graph(in, out, stream);
    StepInput d = in;
    StepOutput o = out;
    size_t slot = 0;
    // Each defined tensor into a buffer of the model's memory of its own
    // (grown as needed); `back` ones are copied back after the step.
    std::vector<std::pair<const Tensor*, Tensor*>> back;
    auto stage = [&](const char* field, const Tensor& host, Tensor& dev, bool copy_in, bool copy_back) {
      if (!host.defined()) return;
      for (int64_t i = host.ndim - 1, stride = 1; i >= 0; stride *= host.shape[i], --i)
        if (host.shape[i] > 1 && host.stride[i] != stride)
          bad("Model.step_from_host", field, "must be contiguous (host tensors are copied as they lie)");
      int64_t elems = 1;
      for (int i = 0; i < host.ndim; ++i) elems *= host.shape[i];
      const size_t bytes = static_cast<size_t>(std::max<int64_t>(elems, 1)) * dtype_size(host.dtype);
      if (slot == staged_.size()) staged_.emplace_back();
      ModelBuffer& buf = staged_[slot++];
      if (buf.bytes() < bytes) buf = ModelBuffer(*ops_, bytes);
      dev = host;  // the same shape, contiguous in the model's memory
      dev.data = buf.get();
      for (int64_t i = host.ndim - 1, stride = 1; i >= 0; stride *= host.shape[i], --i) dev.stride[i] = stride;
      if (copy_in && elems > 0) ops_->copy_in(buf.get(), host.data, bytes);
      if (copy_back) back.emplace_back(&host, &dev);
    };
    stage("token_ids", in.token_ids, d.token_ids, true, false);
    stage("batch.q_start", in.batch.q_start, d.batch.q_start, true, false);
    stage("batch.kv_len", in.batch.kv_len, d.batch.kv_len, true, false);
    stage("batch.block_table", in.batch.block_table, d.batch.block_table, true, false);
    stage("sampling.temperature", in.sampling.temperature, d.sampling.temperature, true, false);
    stage("sampling.top_k", in.sampling.top_k, d.sampling.top_k, true, false);
    stage("sampling.top_p", in.sampling.top_p, d.sampling.top_p, true, false);
    stage("sampling.seed", in.sampling.seed, d.sampling.seed, true, false);
    stage("num_drafts", in.num_drafts, d.num_drafts, true, false);
    stage("known_next", in.known_next, d.known_next, true, false);
    stage("next_tokens", out.next_tokens, o.next_tokens, false, true);
    stage("logits", out.logits, o.logits, false, true);
    stage("accepted", out.accepted, o.accepted, false, true);
    stage("draft_tokens", out.draft_tokens, o.draft_tokens, false, true);
    stage("draft_logits", out.draft_logits, o.draft_logits, false, true);
    // The attention's FlashInfer decode plans from the host copies (no
    // stream synchronization per layer).
    d.batch.host_q_start = in.batch.q_start;
    d.batch.host_kv_len = in.batch.kv_len;
    d.batch.host_block_table = in.batch.block_table;
    step(d, o, stream);
    ops_->sync(stream);
    for (auto [host, dev] : back) {
      int64_t elems = 1;
      for (int i = 0; i < host->ndim; ++i) elems *= host->shape[i];
      if (elems > 0) ops_->copy_out(host->data, dev->data, static_cast<size_t>(elems) * dtype_size(host->dtype));
    }
  }

  // A decode-only step of contiguous host tensors that a bucket's graph
  // can run (ModelOptions.decode_graphs).
  bool graphable(const StepInput& in, const StepOutput& out) const {
    const int B = in.batch.num_requests;
    if (B < 1 || B > o_.attention.max_requests || in.batch.num_decode != B || out.logits.defined() ||
        out.draft_logits.defined() || !in.batch.q_start.defined() || in.batch.q_start.ndim != 1 ||
        in.batch.q_start.shape[0] != B + 1 || !in.batch.block_table.defined() ||
        in.batch.block_table.ndim != 2 || in.batch.block_table.shape[1] > o_.attention.max_pages_per_request)
      return false;
    // Vectors read as they lie (contiguous), as step_from_host copies them.
    for (const Tensor* t : {&in.token_ids, &in.batch.q_start, &in.batch.kv_len, &in.sampling.temperature,
                            &in.sampling.top_k, &in.sampling.top_p, &in.sampling.seed, &in.num_drafts,
                            &in.known_next, &out.next_tokens, &out.accepted, &out.draft_tokens})
      if (t->defined() && (t->ndim != 1 || (t->shape[0] > 1 && t->stride[0] != 1))) return false;
    if (in.batch.block_table.shape[1] > 1 && in.batch.block_table.stride[1] != 1) return false;
    const auto* q = static_cast<const int32_t*>(in.batch.q_start.data);
    for (int i = 0; i < B; ++i)
      if (q[i + 1] - q[i] < 0 || q[i + 1] - q[i] > 2) return false;
    return q[0] == 0 && in.token_ids.defined() && in.token_ids.shape[0] >= q[B] && q[B] <= o_.moe.max_tokens;
  }

  // The rows of a bucket's graph: one or two a request (a step where some
  // request verifies a draft takes the graph of two), no more than the
  // model takes. A step of one row a request runs on a graph of that many
  // rows: the layers' GEMMs and the MoE layer's buckets follow the graph's
  // rows, not the rows that carry tokens.
  int64_t graph_rows(int bucket, int rows_per_request) const {
    return std::min<int64_t>(static_cast<int64_t>(rows_per_request) * bucket, o_.moe.max_tokens);
  }

  // One (bucket, rows a request) graph and the device buffers it reads and writes.
  struct DecodeGraph {
    int bucket = 0;
    ModelBuffer ids, q_start, kv_len, table, temperature, top_k, top_p, seed, drafts, known, next, accepted,
        draft_tokens;
    std::shared_ptr<model::ModelOps::Graph> graph;
    bool warm = false, failed = false;
  };

  DecodeGraph& decode_graph(int B, int rows_per_request) {
    int bucket = 1;
    while (bucket < B) bucket *= 2;
    bucket = std::min(bucket, o_.attention.max_requests);
    auto& slot = decode_graphs_[{bucket, rows_per_request}];
    if (!slot) {
      slot = std::make_unique<DecodeGraph>();
      DecodeGraph& g = *slot;
      const size_t b4 = static_cast<size_t>(bucket) * 4;
      g.bucket = bucket;
      g.ids = ModelBuffer(*ops_, static_cast<size_t>(graph_rows(bucket, rows_per_request)) * 4);
      g.q_start = ModelBuffer(*ops_, b4 + 4);
      for (ModelBuffer* m : {&g.kv_len, &g.temperature, &g.top_k, &g.top_p, &g.drafts, &g.known, &g.next,
                             &g.accepted, &g.draft_tokens})
        *m = ModelBuffer(*ops_, b4);
      g.seed = ModelBuffer(*ops_, 2 * b4);
      g.table = ModelBuffer(*ops_, b4 * o_.attention.max_pages_per_request);
    }
    return *slot;
  }

  // Whether a bucket's graph runs its MoE layers as two micro-batches: the
  // requests split at nb / 2 (each half of up to nb / 2 requests, two rows
  // each at most, within floor(T / 2) rows).
  bool graph_splits(int nb) const {
    return micro_batching() && nb >= 2 && nb <= o_.moe.max_tokens / 2;
  }

  // step_from_host through the graph of its bucket and rows a request (one,
  // or two where a request verifies a draft): the host batch padded to
  // the bucket with empty requests into the graph's buffers; the graph's
  // first step eager, the second captured; FlashInfer's plans made from the
  // padded host copies before each replay. Where the graph runs two
  // micro-batches its slots [0, nb / 2) take the first ceil(B / 2) requests
  // and slots [nb / 2, nb) the others, so both halves carry requests.
  void step_in_graph(const StepInput& in, const StepOutput& out, cudaStream_t stream) {
    const auto called = std::chrono::steady_clock::now();
    const int B = in.batch.num_requests;
    const auto* q = static_cast<const int32_t*>(in.batch.q_start.data);
    int rows_per_request = 1;  // two where a request verifies a draft (graphable: q_len 0 to 2)
    for (int i = 0; i < B && rows_per_request == 1; ++i) rows_per_request = q[i + 1] - q[i] > 1 ? 2 : 1;
    DecodeGraph& g = decode_graph(B, rows_per_request);
    const int nb = g.bucket, P = o_.attention.max_pages_per_request;
    const int64_t rows = graph_rows(nb, rows_per_request);
    const bool two = graph_splits(nb);
    const int half = (B + 1) / 2;
    auto slot_of = [&](int i) { return two && i >= half ? nb / 2 + (i - half) : i; };
    const int64_t cols = in.batch.block_table.shape[1], tstride = in.batch.block_table.stride[0];
    auto i32 = [](const Tensor& t, int i, int32_t d) { return t.defined() ? static_cast<const int32_t*>(t.data)[i] : d; };
    std::vector<int32_t> ids(rows, 0), qs(nb + 1, 0), kl(nb, 0), table(static_cast<size_t>(nb) * P, 0),
        top_k(nb, 0), drafts(nb, 0), known(nb, -1), q_len(nb, 0);
    std::vector<float> temperature(nb, 0.0f), top_p(nb, 1.0f);
    std::vector<int64_t> seed(nb, 0);
    for (int i = 0; i < B; ++i) {
      const int k = slot_of(i);
      q_len[k] = q[i + 1] - q[i];
      kl[k] = i32(in.batch.kv_len, i, 0);
      for (int64_t c = 0; c < cols; ++c)
        table[static_cast<size_t>(k) * P + c] = static_cast<const int32_t*>(in.batch.block_table.data)[i * tstride + c];
      const SamplingParams& sp = in.sampling;
      if (sp.temperature.defined()) temperature[k] = static_cast<const float*>(sp.temperature.data)[i];
      top_k[k] = i32(sp.top_k, i, 0);
      if (sp.top_p.defined()) top_p[k] = static_cast<const float*>(sp.top_p.data)[i];
      if (sp.seed.defined()) seed[k] = static_cast<const int64_t*>(sp.seed.data)[i];
      drafts[k] = i32(in.num_drafts, i, 0);
      known[k] = i32(in.known_next, i, -1);
    }
    for (int k = 0; k < nb; ++k) qs[k + 1] = qs[k] + q_len[k];
    for (int i = 0; i < B; ++i)
      for (int r = 0; r < q[i + 1] - q[i]; ++r) ids[qs[slot_of(i)] + r] = i32(in.token_ids, q[i] + r, 0);
    auto put = [&](ModelBuffer& dst, const void* src, size_t bytes) { ops_->copy_in(dst.get(), src, bytes); };
    put(g.ids, ids.data(), ids.size() * 4);
    put(g.q_start, qs.data(), qs.size() * 4);
    put(g.kv_len, kl.data(), kl.size() * 4);
    put(g.table, table.data(), table.size() * 4);
    put(g.temperature, temperature.data(), temperature.size() * 4);
    put(g.top_k, top_k.data(), top_k.size() * 4);
    put(g.top_p, top_p.data(), top_p.size() * 4);
    put(g.seed, seed.data(), seed.size() * 8);
    put(g.drafts, drafts.data(), drafts.size() * 4);
    put(g.known, known.data(), known.size() * 4);
    StepInput d;
    d.token_ids = Tensor::contiguous(g.ids.get(), DType::kInt32, {rows});
    d.batch.num_requests = d.batch.num_decode = nb;
    d.batch.q_start = Tensor::contiguous(g.q_start.get(), DType::kInt32, {nb + 1});
    d.batch.kv_len = Tensor::contiguous(g.kv_len.get(), DType::kInt32, {nb});
    d.batch.block_table = Tensor::contiguous(g.table.get(), DType::kInt32, {nb, P});
    d.batch.host_q_start = Tensor::contiguous(qs.data(), DType::kInt32, {nb + 1});
    d.batch.host_kv_len = Tensor::contiguous(kl.data(), DType::kInt32, {nb});
    d.batch.host_block_table = Tensor::contiguous(table.data(), DType::kInt32, {nb, P});
    d.sampling.temperature = Tensor::contiguous(g.temperature.get(), DType::kFloat32, {nb});
    d.sampling.top_k = Tensor::contiguous(g.top_k.get(), DType::kInt32, {nb});
    d.sampling.top_p = Tensor::contiguous(g.top_p.get(), DType::kFloat32, {nb});
    d.sampling.seed = Tensor::contiguous(g.seed.get(), DType::kInt64, {nb});
    d.num_drafts = Tensor::contiguous(g.drafts.get(), DType::kInt32, {nb});
    if (mtp_) d.known_next = Tensor::contiguous(g.known.get(), DType::kInt32, {nb});
    StepOutput o;
    o.next_tokens = Tensor::contiguous(g.next.get(), DType::kInt32, {nb});
    o.accepted = Tensor::contiguous(g.accepted.get(), DType::kInt32, {nb});
    if (mtp_) o.draft_tokens = Tensor::contiguous(g.draft_tokens.get(), DType::kInt32, {nb});
    if (!g.warm || g.failed) {
      step(d, o, stream);
      g.warm = true;
      ++graph_stats_.eager_steps;
    } else {
      if (!g.graph) {
        try {
          struct Capturing {  // split_two takes the bucket's split inside the capture
            bool& flag;
            int& split;
            Capturing(bool& f, int& s, int value) : flag(f), split(s) { flag = true, split = value; }
            ~Capturing() { flag = false, split = -1; }
          } capturing(capturing_, graph_split_, two ? nb / 2 : -1);
          g.graph = ops_->capture([&](cudaStream_t s) { step(d, o, s); });
          ++graph_stats_.captures;
        } catch (const Error&) {
          // Something in the step cannot be captured here: this bucket runs
          // eagerly from now (the step itself is not lost: it runs now).
          g.failed = true;
          step(d, o, stream);
          ++graph_stats_.eager_steps;
        }
      }
      if (g.graph && !g.failed) {
        bool planned = true;
        try {
          // The plans the graph's attention calls read: the whole batch's
          // (slot 0) in the layers before the MoE ones and the MTP module,
          // each micro-batch's (slots 1 and 2) in the MoE layers. Every
          // layer's attention shares layer 0's scratch and FlashInfer plans
          // and every cache has one shape, so one preparation a batch serves
          // them all (a layer each cost 5-30 us of host time at 32-128
          // requests: the host batch checked and compared again).
          MicroBatch mb[2];
          if (two) micro_batch_views(d.batch, qs.data(), nb / 2, true, mb);
          MLAAttention& attention = *layers_v_[0].attention;
          if (!two || first_moe_layer() > 0 || static_cast<int>(layers_v_.size()) > layers_)
            attention.prepare_graph_replay(d.batch, kv_cache(0));
          if (two)
            for (const MicroBatch& m : mb)
              if (m.count > 0) attention.prepare_graph_replay(m.batch, kv_cache(0));
        } catch (const InvalidArgument&) {
          planned = false;  // FlashInfer's schedule for this batch has another grid: eagerly this time
        }
        if (planned) {
          ops_->replay(*g.graph, stream);
          ++graph_stats_.replays;
          if (two) ++two_batch_steps_;
        } else {
          step(d, o, stream);
          ++graph_stats_.eager_steps;
        }
      }
    }
    const auto queued = std::chrono::steady_clock::now();
    ops_->sync(stream);
    // Each request's results from its slot.
    auto back = [&](const Tensor& host, const ModelBuffer& dev) {
      if (!host.defined() || B == 0) return;
      std::vector<int32_t> all(nb);
      ops_->copy_out(all.data(), dev.get(), static_cast<size_t>(nb) * 4);
      for (int i = 0; i < B; ++i) static_cast<int32_t*>(host.data)[i] = all[slot_of(i)];
    };
    back(out.next_tokens, g.next);
    back(out.accepted, g.accepted);
    back(out.draft_tokens, g.draft_tokens);
    graph_stats_.host_seconds += std::chrono::duration<double>(queued - called).count();
    graph_stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count();
  }

  void check(cudaStream_t stream) {
    ops_->run_check(stream, [&] { check_layers(stream); });
  }

  void check_layers(cudaStream_t stream) {
    ErrorCollector errors;
    errors.take([&] { check_own(stream); });
    for (Layer& layer : layers_v_) {
      errors.take([&] { layer.attention->check(stream); });
      if (layer.moe) errors.take([&] { layer.moe->check(stream); });
      if (layer.dense) errors.take([&] { layer.dense->experts->check(stream); });
    }
    errors.take([&] { quant_->check(stream); });
    errors.raise();
  }

 private:
  struct Layer {
    std::unique_ptr<MLAAttention> attention;
    std::unique_ptr<MoELayer> moe;
    std::unique_ptr<DenseMlp> dense;
    ModelBuffer post_norm;
  };

  float eps() const { return static_cast<float>(c_.rms_norm_eps); }

  void dense_mlp(DenseMlp& m, const Tensor& out, const Tensor& x, const Tensor& bound, cudaStream_t stream) {
    const int64_t rows = x.shape[0], D = x.shape[1], I = c_.intermediate_size;
    const Tensor xq = Tensor::contiguous(xq_.as(), DType::kFloat8E4M3, {rows, D});
    const Tensor xs = Tensor::contiguous(xs_.as(), DType::kFloat32, {rows, D / 128});
    quant_->quantize(xq, xs, x, bound, stream);
    m.experts->forward(as_single_expert(out), bound, as_single_expert(xq), as_single_expert(xs),
                       Tensor::contiguous(m.w13.as(), DType::kFloat8E4M3, {1, 2 * I, D}),
                       Tensor::contiguous(m.w13_scale.as(), DType::kFloat32, {1, 2 * I / 128, D / 128}),
                       Tensor::contiguous(m.w2.as(), DType::kFloat8E4M3, {1, D, I}),
                       Tensor::contiguous(m.w2_scale.as(), DType::kFloat32, {1, D / 128, I / 128}), stream,
                       rows);  // the step's rows pick the GEMMs' tiles (the config's max_tokens took 2x at 1 row)
  }

  // Attention (its input norm inside), h += it, post-attention norm, the
  // dense MLP or the MoE layer into `part`, h += part.
  void decoder_layer(Layer& layer, int cache, const Tensor& h, const Tensor& normed, const Tensor& part,
                     const MLABatch& batch, int64_t n, const int32_t* rows, const Tensor& bound,
                     cudaStream_t stream) {
    ModelOps& ops = *ops_;
    const int64_t D = c_.attention.hidden_size;
    if (n > 0 && batch.num_requests > 0) {
      const Tensor hv = Tensor::contiguous(h.data, DType::kBFloat16, {n, D}),
                   pv = Tensor::contiguous(part.data, DType::kBFloat16, {n, D});
      layer.attention->forward(pv, hv, batch, kv_cache(cache), stream);
    }
    // h += attention; hn = post_attention_layernorm(h).
    ops.add_rms_norm(h, part, normed, layer.post_norm.as<float>(), eps(), rows, stream);
    if (layer.moe) {
      // num_tokens = max_tokens, alike on every rank: the layer's mode follows it.
      layer.moe->forward(part, normed, bound, stream, o_.moe.max_tokens);
    } else {
      dense_mlp(*layer.dense, part, normed, bound, stream);
    }
    // h += mlp, alone: the next layer's attention norms its own input.
    ops.add_rms_norm(h, part, Tensor{}, nullptr, eps(), rows, stream);
  }

  // ------------------------------------------------------------ two micro-batches

  // A micro-batch of the step: requests [first, first + count) and, at
  // most, `rows` rows (host values: its rows exactly in an eager step, the
  // buffers' bound in a graph, whose replays bring other rows), its batch
  // (plan slot 1 or 2), its row count on the device, and its rows of the
  // residual stream and scratch: the first micro-batch's are the step's
  // first rows, the second's buffers of its own (its rows moved there and
  // back by the device: where they start is q_start[first], which a
  // graph's replays change).
  struct MicroBatch {
    int first = 0, count = 0;
    int64_t rows = 0;
    MLABatch batch;
    int32_t* rows_dev = nullptr;
    const int32_t* row0_dev = nullptr;  // q_start + first: where its rows start in the step's
    Tensor h, normed, part;
  };

  int first_moe_layer() const { return std::min(c_.first_k_dense_replace, layers_); }
  // Whether the MoE layers run two micro-batches (their mode for max_tokens,
  // alike on every rank).
  bool micro_batching() const {
    const int first = first_moe_layer();
    return first < layers_ && layers_v_[first].moe &&
           layers_v_[first].moe->overlap_for(o_.moe.max_tokens) == MoEOverlap::kMicroBatch;
  }
  // The two micro-batches' row capacities: the MoE layers' two AllToAlls'
  // (ceil(T / 2) and floor(T / 2)).
  int64_t micro_capacity(int p) const {
    const int64_t T = o_.moe.max_tokens;
    return p == 0 ? (T + 1) / 2 : T / 2;
  }

  // Splits the step's requests into two micro-batches for two_batch_layers:
  // true when the MoE layers micro-batch, q_start is known on the host and
  // valid, and a split of the requests fits the layers' two AllToAlls (the
  // split with the most even rows; inside a decode graph's capture, the
  // bucket's fixed split graph_split_, whose halves fit by construction).
  bool split_two(const MLABatch& b, int64_t n, MicroBatch (&mb)[2], cudaStream_t stream) {
    if (!micro_batching()) return false;
    const int B = b.num_requests;
    const int32_t* q = nullptr;
    if (B > 0) {
      q = static_cast<const int32_t*>(host_ ? b.q_start.data : b.host_q_start.data);
      if (q == nullptr || q[0] != 0) return false;
      for (int i = 0; i < B; ++i)
        if (q[i + 1] < q[i]) return false;  // a bad q_start: the layers' forward reports it
      if (q[B] > n) return false;
    }
    int split = -1;
    if (capturing_) {
      split = graph_split_;
    } else {
      const int64_t total = B > 0 ? q[B] : 0;
      int64_t gap = 0;
      for (int i = 0; i <= B; ++i) {
        const int64_t ra = B > 0 ? q[i] : 0;
        if (ra > micro_capacity(0) || total - ra > micro_capacity(1)) continue;
        const int64_t g = std::abs(2 * ra - total);
        if (split < 0 || g < gap) split = i, gap = g;
      }
    }
    if (split < 0) return false;
    micro_batch_views(b, q, split, capturing_, mb);
    // On the device: the second's q_start rebased, both row counts.
    for (int p = 0; p < 2; ++p) {
      MicroBatch& m = mb[p];
      if (B == 0) {
        ops_->copy_async(m.rows_dev, zero_.as(), 4, stream);
        continue;
      }
      if (p == 1) ops_->rebase_offsets(two_q_start_.as<int32_t>(), static_cast<const int32_t*>(b.q_start.data),
                                       m.first, m.count, stream);
      ops_->step_rows(static_cast<const int32_t*>(m.batch.q_start.data), m.count, m.rows, m.rows_dev, stream);
    }
    return true;
  }

  // The two micro-batches' views of batch b split before request `split`
  // (host q_start q, null without requests): their requests, batches (plan
  // slots 1 and 2, the second's q_start rebased into two_q_start_ and on the
  // host), row bounds (exact, or the capacities in a graph) and buffers.
  // Host work only: a graph's replays make these again to plan FlashInfer.
  void micro_batch_views(const MLABatch& b, const int32_t* q, int split, bool graph, MicroBatch (&mb)[2]) {
    const int B = b.num_requests;
    const int64_t D = c_.attention.hidden_size;
    const int32_t* q_dev = static_cast<const int32_t*>(b.q_start.data);
    for (int p = 0; p < 2; ++p) {
      MicroBatch& m = mb[p];
      m = MicroBatch{};
      m.first = p == 0 ? 0 : split;
      m.count = p == 0 ? split : B - split;
      const int64_t exact = B > 0 ? q[m.first + m.count] - q[m.first] : 0;
      m.rows = graph ? micro_capacity(p) : exact;
      m.rows_dev = two_rows_.as<int32_t>() + p;
      m.row0_dev = B > 0 ? q_dev + m.first : nullptr;
      const int64_t shape_rows = std::max<int64_t>(std::min(m.rows, micro_capacity(p)), 1);
      const ModelBuffer* bufs[3] = {&h_, &normed_, &part_};
      if (p == 1) bufs[0] = &two_h_, bufs[1] = &two_normed_, bufs[2] = &two_part_;
      Tensor* views[3] = {&m.h, &m.normed, &m.part};
      for (int k = 0; k < 3; ++k) *views[k] = Tensor::contiguous(bufs[k]->as(), DType::kBFloat16, {shape_rows, D});
      MLABatch& s = m.batch;
      s.num_requests = m.count;
      s.num_decode = std::clamp(b.num_decode - m.first, 0, m.count);
      s.plan_slot = 1 + p;
      if (B == 0) continue;
      const int32_t* qs = p == 0 ? q_dev : two_q_start_.as<int32_t>();
      s.q_start = Tensor::contiguous(const_cast<int32_t*>(qs), DType::kInt32, {m.count + 1});
      s.kv_len = rows_of(b.kv_len, m.first, m.count);
      s.block_table = rows_of(b.block_table, m.first, m.count);
      if (!host_ && b.host_q_start.defined()) {
        host_q_start_[p].assign(q + m.first, q + m.first + m.count + 1);
        for (int32_t& v : host_q_start_[p]) v -= q[m.first];
        s.host_q_start = Tensor::contiguous(host_q_start_[p].data(), DType::kInt32, {m.count + 1});
        if (b.host_kv_len.defined()) s.host_kv_len = rows_of(b.host_kv_len, m.first, m.count);
        if (b.host_block_table.defined()) s.host_block_table = rows_of(b.host_block_table, m.first, m.count);
      }
    }
  }

  // The MoE layers from `first` on, two micro-batches three stages apart:
  //   a: attention, norm, dispatch send + shared expert (stage_begin)
  //   b: the same
  //   per layer: a dispatch receive, experts, combine send; b the same;
  //              a combine receive, h += it, a's next attention and send;
  //              b combine receive, h += it, b's next attention and send
  // so that one micro-batch's transfers run under the other's compute. Each
  // works on its own rows of h, normed and part: the second's residual
  // rows move into its buffer first and back after the last layer.
  void two_batch_layers(MicroBatch (&mb)[2], int first, cudaStream_t stream) {
    ModelOps& ops = *ops_;
    const Tensor h = Tensor::contiguous(h_.as(), DType::kBFloat16, {o_.moe.max_tokens, c_.attention.hidden_size});
    if (mb[1].row0_dev != nullptr) ops.move_rows(mb[1].h, h, mb[1].row0_dev, mb[1].rows_dev, true, stream);
    auto begin = [&](int p, int l) {
      Layer& layer = layers_v_[l];
      const MicroBatch& m = mb[p];
      if (m.rows > 0 && m.count > 0) layer.attention->forward(m.part, m.h, m.batch, kv_cache(l), stream);
      ops.add_rms_norm(m.h, m.part, m.normed, layer.post_norm.as<float>(), eps(), m.rows_dev, stream);
      layer.moe->stage_begin(p, m.part, m.normed, Tensor::contiguous(m.rows_dev, DType::kInt32, {1}), stream);
    };
    auto end = [&](int p, int l) {
      const MicroBatch& m = mb[p];
      layers_v_[l].moe->stage_end(p, stream);
      ops.add_rms_norm(m.h, m.part, Tensor{}, nullptr, eps(), m.rows_dev, stream);
    };
    begin(0, first);
    begin(1, first);
    for (int l = first; l < layers_; ++l) {
      MoELayer& moe = *layers_v_[l].moe;
      moe.stage_middle(0, stream);
      moe.stage_middle(1, stream);
      end(0, l);
      if (l + 1 < layers_) begin(0, l + 1);
      end(1, l);
      if (l + 1 < layers_) begin(1, l + 1);
    }
    if (mb[1].row0_dev != nullptr) ops.move_rows(mb[1].h, h, mb[1].row0_dev, mb[1].rows_dev, false, stream);
  }

  // lm_head on the rows sampled (each request's last row, and the row
  // before each draft), the samples, the drafts' verdict; the logits asked for.
  void sample_and_verify(const StepInput& in, const StepOutput& out, const Tensor& normed, const int32_t* rows,
                         cudaStream_t stream) {
    ModelOps& ops = *ops_;
    const int B = in.batch.num_requests;
    const int64_t V = c_.vocab_size;
    const auto* q_start = static_cast<const int32_t*>(in.batch.q_start.data);
    const auto* kv_len = static_cast<const int32_t*>(in.batch.kv_len.data);
    const bool drafts = in.num_drafts.defined();
    const int slots = drafts ? kSampleSlots : 1;
    auto* sample_rows = sample_rows_.as<int32_t>();
    auto* error = error_.as<ModelErrorRecord>();
    ops.plan_samples(q_start, kv_len, drafts ? static_cast<const int32_t*>(in.num_drafts.data) : nullptr, B,
                     slots, rows, sample_rows, sample_pos_.as<int32_t>(), error, stream);
    const Tensor logits = Tensor::contiguous(sample_logits_.as(), DType::kFloat32, {B * slots, V});
    ops.lm_head(logits, normed, lm_head_.as<uint16_t>(), V, rows, sample_rows, stream);
    if (out.logits.defined()) {
      if (out.logits_every_row) {
        ops.lm_head(out.logits, normed, lm_head_.as<uint16_t>(), V, rows, nullptr, stream);
      } else if (!drafts) {  // the slots are the last rows
        ops.copy_async(out.logits.data, logits.data, static_cast<size_t>(B) * V * 4, stream);
      } else {
        auto* last = last_rows_.as<int32_t>();
        ops.plan_samples(q_start, kv_len, nullptr, B, 1, rows, last, last + B, error, stream);
        ops.lm_head(out.logits, normed, lm_head_.as<uint16_t>(), V, rows, last, stream);
      }
    }
    const Tensor samples = Tensor::contiguous(samples_.as(), DType::kInt32, {B * slots});
    const SamplingParams& sp = in.sampling;
    ops.sample(samples, logits, sp.temperature, sp.top_k, sp.top_p, sp.seed, sample_rows,
               sample_pos_.as<int32_t>(), slots, error, stream);
    ops.accept_drafts(samples_.as<int32_t>(), sample_rows, slots, in.token_ids, q_start,
                      in.known_next.defined() ? static_cast<const int32_t*>(in.known_next.data) : nullptr, B,
                      static_cast<int32_t*>(out.next_tokens.data), out.next_tokens.ndim ? out.next_tokens.stride[0] : 1,
                      out.accepted.defined() ? static_cast<int32_t*>(out.accepted.data) : nullptr,
                      mtp_ ? mtp_->tokens.as<int32_t>() : nullptr, mtp_ ? mtp_->draft_row.as<int32_t>() : nullptr,
                      stream);
  }

  // The MTP module over every row (its KV cache stays whole), on the final
  // norm's output in `normed` and the tokens accept_drafts chose; the
  // draft of each request from the row after its last accepted token.
  // Every rank runs it (its MoE layer is a collective), with or without rows.
  void mtp_step(const StepInput& in, const StepOutput& out, const Tensor& h, const Tensor& normed,
                const Tensor& part, int64_t n, const int32_t* rows, const Tensor& bound, cudaStream_t stream) {
    ModelOps& ops = *ops_;
    Mtp& m = *mtp_;
    const int B = in.batch.num_requests;
    const int64_t D = c_.attention.hidden_size, V = c_.vocab_size, nr = h.shape[0];
    auto* error = error_.as<ModelErrorRecord>();
    if (n > 0 && B > 0) {
      // joined = [enorm(embed(next tokens)), hnorm(normed)]; h = eh_proj(joined).
      Tensor left = Tensor::contiguous(m.joined.as(), DType::kBFloat16, {nr, D});
      Tensor right = left;
      left.stride[0] = right.stride[0] = 2 * D;
      right.data = m.joined.as<uint16_t>() + D;
      ops.embed(part, Tensor::contiguous(m.tokens.as(), DType::kInt32, {n}), embed_.as<uint16_t>(), V, rows, error,
                stream);
      ops.add_rms_norm(part, Tensor{}, left, m.enorm.as<float>(), eps(), rows, stream);
      ops.add_rms_norm(normed, Tensor{}, right, m.hnorm.as<float>(), eps(), rows, stream);
      ops.linear(Tensor::contiguous(h.data, DType::kBFloat16, {n, D}),
                 Tensor::contiguous(m.joined.as(), DType::kBFloat16, {n, 2 * D}), m.eh_proj.as<uint16_t>(), rows,
                 stream);
    }
    decoder_layer(layers_v_[layers_], layers_, h, normed, part, in.batch, n, rows, bound, stream);
    if (B == 0) return;
    ops.add_rms_norm(h, Tensor{}, normed, m.shared_norm.as<float>(), eps(), rows, stream);
    const Tensor logits = Tensor::contiguous(m.logits.as(), DType::kFloat32, {B, V});
    const auto* draft_row = m.draft_row.as<int32_t>();
    ops.lm_head(logits, normed, m.head.as<uint16_t>(), V, rows, draft_row, stream);
    const Tensor drafts = out.draft_tokens.defined() ? out.draft_tokens
                                                     : Tensor::contiguous(m.drafts.as(), DType::kInt32, {B});
    ops.sample(drafts, logits, Tensor{}, Tensor{}, Tensor{}, Tensor{}, draft_row, draft_row, 1, error, stream);
    if (out.draft_logits.defined())
      ops.copy_async(out.draft_logits.data, logits.data, static_cast<size_t>(B) * V * 4, stream);
  }

  void check_own(cudaStream_t stream) {
    const ModelErrorRecord e = ops_->take_error(error_.as<ModelErrorRecord>(), stream);
    if (e.code == 1)
      throw InputError("moelink: Model.step: token_ids[" + std::to_string(e.row) + "] = " +
                       std::to_string(static_cast<int64_t>(e.value)) + " is outside [0, " +
                       std::to_string(e.limit) + ") (vocab_size); its row was zeroed");
    if (e.code == 2) {
      static const char* fields[] = {"temperature", "top_k", "top_p"};
      static const char* rules[] = {">= 0", ">= 0", "in (0, 1]"};
      throw InputError("moelink: Model.step: sampling." + std::string(fields[e.field]) + "[" +
                       std::to_string(e.row) + "] = " + std::to_string(e.value) + " must be " +
                       rules[e.field] + "; request " + std::to_string(e.row) + " got next token -1");
    }
    if (e.code == 3)
      throw InputError("moelink: Model.step: num_drafts[" + std::to_string(e.row) + "] = " +
                       std::to_string(static_cast<int64_t>(e.value)) + " must be in [0, " +
                       std::to_string(e.limit) + "] (at most " + std::to_string(kMaxDrafts) +
                       " and fewer than the request's rows); it was read as 0");
  }

  void check_outputs(const char* call, const StepOutput& out, int64_t n, int B, int64_t V) const {
    if (check_tensor(call, "next_tokens", out.next_tokens, {DType::kInt32}, {}, false) != B)
      bad(call, "next_tokens", "has shape " + shape_str(out.next_tokens) + ", expected [" +
                                   std::to_string(B) + "] (num_requests)");
    if (!out.logits.defined()) return;
    const int64_t want = out.logits_every_row ? n : B;
    if (want == 0 && out.logits.ndim == 2 && out.logits.shape[0] == 0) return;  // nothing to write
    if (check_tensor(call, "logits", out.logits, {DType::kFloat32}, {V}, true) != want ||
        out.logits.stride[0] != V)
      bad(call, "logits", "has shape " + shape_str(out.logits) + ", expected a contiguous [" +
                              std::to_string(want) + ", " + std::to_string(V) + "] (" +
                              (out.logits_every_row ? "every row" : "each request's last row") + ")");
  }

  // num_drafts, known_next and the draft outputs: [B] int32 (or [B, V]
  // fp32), contiguous; the MTP ones only with ModelOptions.mtp.
  void check_step_vectors(const char* call, const StepInput& in, const StepOutput& out, int B, int64_t V) const {
    auto vec = [&](const char* field, const Tensor& t) {
      if (!t.defined()) return;
      if (t.ndim != 1 || t.shape[0] != B || t.dtype != DType::kInt32 || (B > 1 && t.stride[0] != 1))
        bad(call, field, "must be a contiguous int32 tensor of shape [" + std::to_string(B) + "], got dtype " +
                             std::string(dtype_name(t.dtype)) + " shape " + shape_str(t));
    };
    vec("num_drafts", in.num_drafts);
    vec("known_next", in.known_next);
    vec("accepted", out.accepted);
    vec("draft_tokens", out.draft_tokens);
    if (!mtp_) {
      for (auto [field, t] : {std::pair{"known_next", &in.known_next}, std::pair{"draft_tokens", &out.draft_tokens},
                              std::pair{"draft_logits", &out.draft_logits}})
        if (t->defined()) bad(call, field, "needs ModelOptions.mtp (the model runs no MTP module)");
    }
    if (out.draft_logits.defined() &&
        (check_tensor(call, "draft_logits", out.draft_logits, {DType::kFloat32}, {V}, true) != B ||
         out.draft_logits.stride[0] != V))
      bad(call, "draft_logits", "has shape " + shape_str(out.draft_logits) + ", expected a contiguous [" +
                                    std::to_string(B) + ", " + std::to_string(V) + "]");
  }

  static void check_sampling(const char* call, const SamplingParams& s, int B) {
    auto vec = [&](const char* field, const Tensor& t, DType dt) {
      if (!t.defined()) return;
      if (t.ndim != 1 || t.shape[0] != B || t.dtype != dt || (B > 1 && t.stride[0] != 1))
        bad(call, field, "must be a contiguous " + std::string(dtype_name(dt)) + " tensor of shape [" +
                             std::to_string(B) + "], got dtype " + std::string(dtype_name(t.dtype)) +
                             " shape " + shape_str(t));
    };
    vec("sampling.temperature", s.temperature, DType::kFloat32);
    vec("sampling.top_k", s.top_k, DType::kInt32);
    vec("sampling.top_p", s.top_p, DType::kFloat32);
    vec("sampling.seed", s.seed, DType::kInt64);
  }

  ModelConfig c_;
  ModelOptions o_;
  int layers_ = 0;
  bool host_ = true, has_weights_ = false;
  std::unique_ptr<ModelOps> ops_;
  std::vector<ModelBuffer> staged_;  // step_from_host's copies of the step's tensors (ops_'s memory)
  std::vector<Layer> layers_v_;
  // The MTP module's own weights and buffers (ModelOptions.mtp); its
  // decoder layer is layers_v_[layers_].
  struct Mtp {
    ModelBuffer enorm, hnorm, shared_norm, eh_proj, head;  // norms fp32; eh_proj [D, 2D], head [V, D] bf16
    ModelBuffer joined;     // [T, 2D] bf16: its input before eh_proj
    ModelBuffer tokens;     // [T] int32: the token after each row
    ModelBuffer draft_row;  // [max_requests] int32
    ModelBuffer drafts;     // [max_requests] int32, when the caller takes none
    ModelBuffer logits;     // [max_requests, V] fp32
  };
  std::unique_ptr<Experts> quant_;
  std::unique_ptr<Mtp> mtp_;
  // Sampling: lm_head's rows (kSampleSlots per request), their positions,
  // the tokens drawn, each request's last row (logits with drafts).
  ModelBuffer sample_logits_, sample_rows_, sample_pos_, samples_, last_rows_;
  ModelBuffer h_, normed_, part_, xq_, xs_, error_, zero_, rows_, final_norm_, embed_, lm_head_;
  ModelBuffer kv_region_;  // every cache, cache_bytes_ each
  std::map<std::pair<int, int>, std::unique_ptr<DecodeGraph>> decode_graphs_;  // by bucket and rows a request
  DecodeGraphStats graph_stats_;
  int64_t cache_bytes_ = 0;
  // Two micro-batches (split_two): the second's q_start on the device and
  // the host, both row counts on the device; how many steps ran so; whether
  // a decode graph is being captured (its replays may split elsewhere).
  ModelBuffer two_q_start_, two_rows_, two_h_, two_normed_, two_part_;
  std::vector<int32_t> host_q_start_[2];
  int64_t two_batch_steps_ = 0;
  bool capturing_ = false;
  int graph_split_ = -1;  // inside a capture: the bucket's split of its requests (-1: none)
};

}  // namespace detail

std::unique_ptr<Model> Model::create(const ModelConfig& config, const ModelOptions& options,
                                     Bootstrap& bootstrap) {
  return std::unique_ptr<Model>(new Model(std::make_unique<detail::ModelImpl>(config, options, bootstrap)));
}
Model::Model(std::unique_ptr<detail::ModelImpl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;
const ModelConfig& Model::config() const { return impl_->config(); }
int Model::num_layers() const { return impl_->num_layers(); }
bool Model::mtp() const { return impl_->mtp(); }
DecodeGraphStats Model::decode_graph_stats() const { return impl_->decode_graph_stats(); }
int64_t Model::two_batch_steps() const { return impl_->two_batch_steps(); }
void Model::load_checkpoint(const std::string& directory) { impl_->load_checkpoint(directory); }
Tensor Model::kv_cache(int layer) const { return impl_->kv_cache(layer); }
Tensor Model::kv_cache_region() const { return impl_->kv_cache_region(); }
void Model::step(const StepInput& in, const StepOutput& out, cudaStream_t stream) { impl_->step(in, out, stream); }
void Model::step_from_host(const StepInput& in, const StepOutput& out, cudaStream_t stream) {
  impl_->step_from_host(in, out, stream);
}
void Model::check(cudaStream_t stream) { impl_->check(stream); }

}  // namespace moelink
