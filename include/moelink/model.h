// Model: a DeepSeek-V3-family model (DeepSeek-V3/R1, Kimi-K2) from token ids
// to next-token choices, on moelink's parts: embedding, decoder layers (MLA
// attention, then a dense MLP for the first first_k_dense_replace layers and
// a MoELayer for the others, each behind an RMSNorm with a residual), the
// final norm and lm_head, then sampling.
//
// One step() runs a mixed batch (MLABatch's rules: decode requests first,
// then prefill chunks) through every layer on its rank's tokens; the MoE
// layers exchange tokens with the other ranks (expert parallelism over any
// AllToAll backend), so every rank calls step() for every step, with its own
// batch (DP attention: batch sizes may differ, a rank may have none).
//
// Notation: D hidden_size, V vocab_size, n the step's rows, B its requests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moelink/attention.h"
#include "moelink/bootstrap.h"
#include "moelink/moe_layer.h"
#include "moelink/types.h"

namespace moelink {

struct ModelConfig {
  MLAConfig attention;
  MoEModelConfig moe;
  int vocab_size = 0;
  int num_hidden_layers = 0;
  int first_k_dense_replace = 0;  // the first layers' MLP is dense
  int intermediate_size = 0;      // the dense MLP's width, a multiple of 128
  double rms_norm_eps = 1e-6;
  int num_nextn_predict_layers = 0;  // MTP modules in the checkpoint (ModelOptions.mtp runs the first)
  bool tie_word_embeddings = false;

  static ModelConfig deepseek_v3();  // also DeepSeek-R1
  static ModelConfig kimi_k2();
  // "deepseek-v3", "deepseek-r1", "kimi-k2".
  static ModelConfig preset(const std::string& name);
  // From a Hugging Face config.json (text): DeepseekV3Config's fields.
  static ModelConfig from_hf_config_json(const std::string& json_text);
  // Throws InvalidArgument naming the field, its value and the rule.
  void validate() const;
};

struct ModelOptions {
  // Load and run only the first num_layers decoder layers (benchmarks on one
  // GPU); 0: all of them.
  int num_layers = 0;
  // The MoE layers' options: max_tokens is the step's rows (n <= it), backend
  // and overlap mode, dp_size. Its device decides the model's: a host backend
  // (cpu, internode-cpu) runs the CPU path.
  MoELayerOptions moe;
  // The attention's: page_size, max_requests, max_pages_per_request, TP
  // (device and max_tokens are the model's).
  MLAOptions attention;
  // Pages of the KV cache the model allocates for each layer
  // ([num_pages, page_size, kv_lora_rank + qk_rope_head_dim] bf16).
  int64_t num_pages = 0;
  // Multi-token prediction: also run the checkpoint's first MTP module
  // (layer num_hidden_layers: enorm, hnorm, eh_proj, a decoder layer with a
  // KV cache of its own, shared_head) on every step, so each request gets a
  // draft of the token after its next one (StepOutput.draft_tokens), which
  // the next step can verify (StepInput.num_drafts). Needs
  // num_nextn_predict_layers >= 1; the same on every rank (its decoder
  // layer is a MoE layer, a collective).
  bool mtp = false;
  // GPU backends: step_from_host() runs decode-only steps (every request
  // decoding, q_len 1 or 2, no logits asked for) through one CUDA graph per
  // batch-size bucket (1, 2, 4, ..., max_requests requests, padded with
  // empty ones) and rows a request (1, or 2 where some request verifies a
  // draft): a graph's first step runs eagerly (its workspaces reach
  // their sizes), its second captures the graph, every later one replays it
  // with the new tokens, lengths, pages and sampling. Prefill and mixed
  // steps run eagerly. FlashInfer's decode is captured too (its plan made on
  // the host before each replay).
  bool decode_graphs = false;
};

// Per-request sampling, read where the step runs: greedy where temperature
// is 0, else softmax(logits / temperature) restricted to the top_k largest
// (0: all) and to the smallest set whose mass reaches top_p, drawn with a
// counter-based generator keyed by (seed, position): the same request,
// position and seed give the same token on any rank, batch and device.
struct SamplingParams {
  Tensor temperature;  // [B] fp32, >= 0
  Tensor top_k;        // [B] int32, >= 0
  Tensor top_p;        // [B] fp32, in (0, 1]
  Tensor seed;         // [B] int64
};

// How step_from_host's decode-only steps ran with ModelOptions.decode_graphs:
// replayed from a bucket's graph, or eagerly (a bucket's first step, a
// capture that failed, or a batch whose FlashInfer schedule needs another
// grid than the captured one); captures: graphs captured. Benchmarks read
// it to say which steps they timed. host_seconds / wait_seconds split
// those steps' host clock: from the call until the step's work is queued
// (the batch laid out in its slots and copied in, the attention's plans,
// the launch) / from there until its results are back on the host (the
// device's time, less what overlapped the host's part). A server's decode
// step set against a benchmark's shows which side grew.
struct DecodeGraphStats {
  int64_t replays = 0, eager_steps = 0, captures = 0;
  double host_seconds = 0.0, wait_seconds = 0.0;
};

struct StepInput {
  Tensor token_ids;  // [n] int32: the query tokens (rows of the batch); may be undefined when B = 0
  MLABatch batch;    // request i's rows, lengths and pages (shared by every layer)
  SamplingParams sampling;  // undefined tensors: greedy for every request
  // Speculative decoding (optional, undefined: no drafts): request i's last
  // num_drafts[i] rows are draft tokens (e.g. the previous step's
  // draft_tokens[i]) to verify, [B] int32 in [0, min(1, q_len_i - 1)]. The
  // step samples the row before each draft and the last row, accepts drafts
  // while the sample before each equals it, and reports in next_tokens the
  // sample after the accepted ones: the tokens a request gets are the ones
  // it would get without drafts (sampling is keyed by position). The KV
  // rows of rejected drafts are left in the cache, to be overwritten.
  Tensor num_drafts;
  // With ModelOptions.mtp (optional): known_next[i] >= 0 is the token that
  // follows request i's last row when the caller knows it (a prefill chunk
  // that does not end its prompt), -1 where not; the MTP module then embeds
  // it instead of the sampled token. [B] int32; ignored for requests with
  // drafts.
  Tensor known_next;
};

struct StepOutput {
  // [B] int32 (required): sampled from each request's last row, or with
  // drafts the row after its last accepted draft; -1 for an empty request.
  Tensor next_tokens;
  // Optional fp32 logits: [B, V] of each request's last row, or with
  // logits_every_row [n, V] of every row (teacher forcing, scoring).
  Tensor logits;
  bool logits_every_row = false;
  Tensor accepted;  // optional [B] int32: the drafts accepted (0 without)
  // With ModelOptions.mtp (optional): [B] int32, the MTP module's greedy
  // proposal for the token after next_tokens[i] (-1 for an empty request),
  // and its logits [B, V] fp32.
  Tensor draft_tokens;
  Tensor draft_logits;
};

namespace detail {
class ModelImpl;
}

class Model {
 public:
  // Collective over the ranks of `bootstrap` (the MoE layers' AllToAlls).
  static std::unique_ptr<Model> create(const ModelConfig& config, const ModelOptions& options,
                                       Bootstrap& bootstrap);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  int num_layers() const;  // the layers run (options.num_layers or all)
  bool mtp() const;        // ModelOptions.mtp: steps propose drafts
  DecodeGraphStats decode_graph_stats() const;  // since creation (zeros without decode_graphs)
  // Steps whose MoE layers ran as two micro-batches interleaved across
  // attention and MoE (since creation). That happens when the MoE layers'
  // mode for max_tokens is micro-batch (overlap micro-batch, or auto with
  // more than one rank and max_tokens >= micro_batch_min_tokens) and the
  // step's q_start is known on the host (step_from_host, host copies, the
  // CPU path) and splits into halves the layer's AllToAlls take; other
  // steps (and captured decode steps) micro-batch inside each MoE layer.
  int64_t two_batch_steps() const;

  // A Hugging Face checkpoint directory (config.json's model): embedding,
  // every layer's norms, attention, dense MLP or MoE layer (this rank's
  // experts only), the final norm and lm_head. fp8 with weight_scale_inv or
  // bf16; a missing tensor or a wrong shape throws InvalidArgument naming
  // the tensor and the file.
  void load_checkpoint(const std::string& directory);

  // The KV cache of layer `layer` ([num_pages, page_size, Dc] bf16); with
  // ModelOptions.mtp, layer num_layers() is the MTP module's.
  Tensor kv_cache(int layer) const;
  // Every cache in one region ([caches * num_pages * page_size * Dc * 2]
  // uint8, cache l from byte l * num_pages * page_size * Dc * 2; caches:
  // num_layers(), plus one with mtp), for registering it once with a
  // TransferEngine (P/D disaggregation): page p of cache l is a
  // layer-major KvCacheLayout's page (bytes_per_token Dc * 2).
  Tensor kv_cache_region() const;

  // One step. Host tensors for the CPU path, device tensors otherwise.
  void step(const StepInput& in, const StepOutput& out, cudaStream_t stream = nullptr);

  // One step on contiguous host tensors whatever the backend (the serving
  // engine builds its steps on the host): on a GPU backend they are copied
  // into the model's memory, and next_tokens (and logits) back once the
  // step has run. The CPU path's step() itself.
  void step_from_host(const StepInput& in, const StepOutput& out, cudaStream_t stream = nullptr);

  // Waits and throws what any part flagged since the last check().
  void check(cudaStream_t stream = nullptr);

 private:
  explicit Model(std::unique_ptr<detail::ModelImpl> impl);
  std::unique_ptr<detail::ModelImpl> impl_;
};

}  // namespace moelink
