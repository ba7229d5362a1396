// MoELayer: a whole Mixture-of-Experts layer on one object: router,
// quantization, dispatch, shared expert, expert GEMMs, combine, in DeepSeek-V3's
// fp8 format, on any AllToAll backend (the layer creates its own AllToAll).
//
//   out[t] = shared_expert(x[t]) + sum_i weights[t][i] * expert_{indices[t][i]}(x[t])
//
// for the m = bound_m[0] tokens of this rank, on the caller's CUDA stream (host
// loops for the host backends), m read only on the device. Notation: H
// hidden_size, E routed experts, k experts per token, L = E / world_size local
// experts, I moe_intermediate_size, Is = n_shared_experts * I, T max_tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moelink/all_to_all.h"
#include "moelink/bootstrap.h"
#include "moelink/types.h"

namespace moelink {

enum class ScoringFunction {
  kSigmoid,  // DeepSeek-V3/R1, Kimi-K2: sigmoid(logits), group-limited top-k
  kSoftmax,  // Mixtral, Qwen3-MoE: softmax(logits), top-k
};

// A MoE layer's architecture; field names follow Hugging Face's config.json.
struct MoEModelConfig {
  std::string name;
  int hidden_size = 0;            // H, a multiple of 128
  int moe_intermediate_size = 0;  // I per expert, a multiple of 128
  int n_routed_experts = 0;       // E
  int n_shared_experts = 0;       // shared experts, one MLP of n_shared_experts * I (0: none)
  int num_experts_per_tok = 0;    // k, 1..16
  // Group-limited routing (DeepSeek's noaux_tc): the experts form n_group
  // groups, each scored by the sum of its two best scores; only the best
  // topk_group groups compete for the k experts. 1 and 1: plain top-k.
  int n_group = 1;
  int topk_group = 1;
  ScoringFunction scoring = ScoringFunction::kSoftmax;
  // e_score_correction_bias: added to the scores to choose experts, not to
  // weight them.
  bool score_correction_bias = false;
  bool norm_topk_prob = true;  // weights divided by their sum
  float routed_scaling_factor = 1.0f;
  // Tensor names in a checkpoint: "deepseek" (mlp.gate, mlp.experts.N.{gate,up,down}_proj,
  // mlp.shared_experts) or "mixtral" (block_sparse_moe.gate, block_sparse_moe.experts.N.{w1,w3,w2}).
  std::string checkpoint_naming = "deepseek";

  static MoEModelConfig deepseek_v3();  // also DeepSeek-R1
  static MoEModelConfig kimi_k2();
  static MoEModelConfig qwen3_235b_a22b();
  static MoEModelConfig mixtral_8x7b();
  // "deepseek-v3", "deepseek-r1", "kimi-k2", "qwen3-235b-a22b", "mixtral-8x7b".
  static MoEModelConfig preset(const std::string& name);
  // From a Hugging Face config.json (text): hidden_size, moe_intermediate_size
  // (Mixtral: intermediate_size), n_routed_experts / num_experts /
  // num_local_experts, n_shared_experts, num_experts_per_tok, n_group,
  // topk_group, scoring_func, norm_topk_prob, routed_scaling_factor, and the
  // model_type for the bias and the tensor names.
  static MoEModelConfig from_hf_config_json(const std::string& json_text);

  int shared_intermediate_size() const { return n_shared_experts * moe_intermediate_size; }
  // Throws InvalidArgument naming the field, its value and the rule.
  void validate() const;
  std::string to_string() const;
};

// How the layer overlaps communication with computation (seed article 002).
enum class MoEOverlap {
  kAuto,             // kMicroBatch where moe_auto_micro_batches and from micro_batch_min_tokens, else kDispatchOverlap
  kNone,             // shared expert, dispatch, experts, combine: one after the other
  kDispatchOverlap,  // the shared expert runs between dispatch's send and receive halves
  kMicroBatch,       // two micro-batches whose stages interleave: one's transfer under the other's compute
};
const char* moe_overlap_name(MoEOverlap m);  // "auto", "none", "dispatch-overlap", "micro-batch"
// Whether kAuto micro-batches at all (from micro_batch_min_tokens) on this
// backend and world: only where the exchange may cross nodes (kNVSHMEM,
// kInternode, kInternodeCPU) and world_size > 1. On one node (kNVLink,
// kCPU) there is little transfer to hide and each micro-batch reads every
// expert's weights again: about 2x the MoE layer's time at 128 tokens
// measured on one H200, and moelink-plan predicts mode dispatch a 1.4-1.7x
// faster DeepSeek-V3 step than micro-batch at EP8 on one node at every
// batch (docs/moe_layer.md).
bool moe_auto_micro_batches(Backend backend, int world_size);

struct MoELayerOptions {
  int64_t max_tokens = 0;  // T: tokens per rank one forward() may carry, 1..65536
  MoEOverlap overlap = MoEOverlap::kAuto;
  // kAuto: micro-batches from this many tokens per rank on, where
  // moe_auto_micro_batches (the seed found them slower below 32 across
  // nodes).
  int64_t micro_batch_min_tokens = 32;
  // forward() through one captured CUDA graph per token bucket (1, 2, 4, ...,
  // T), replayed with new tokens and m; the first forward() of a bucket
  // captures it. GPU backends only.
  bool cuda_graphs = false;
  // The AllToAll's options (backend, timeouts, fabric...). Its Config comes
  // from the model: max_num_tokens T (T/2 for each of the two micro-batch
  // AllToAlls), fp8 tokens with H/128 scales, bf16 combine.
  Options all_to_all;
  int dp_size = 1;
};

// This rank's weights, as views in host or device memory; set_weights()
// copies them (the layer owns its copy). fp8 expert weights come with their
// 128 x 128 block scales (a checkpoint's weight_scale_inv); bf16 expert
// weights (scales undefined) are quantized to 128 x 128 blocks on the way in.
struct MoEWeights {
  Tensor gate;       // [E, H] bf16 or fp32: the router (used in bf16)
  Tensor gate_bias;  // [E] fp32: e_score_correction_bias (when the model has it)
  Tensor w13;        // [L, 2I, H] fp8 or bf16: gate_proj rows, then up_proj rows
  Tensor w13_scale;  // [L, 2I/128, H/128] fp32 (fp8 w13 only)
  Tensor w2;         // [L, H, I] fp8 or bf16: down_proj
  Tensor w2_scale;   // [L, H/128, I/128] fp32 (fp8 w2 only)
  Tensor shared_w13, shared_w13_scale;  // [2 Is, H], [2 Is/128, H/128] (when n_shared_experts > 0)
  Tensor shared_w2, shared_w2_scale;    // [H, Is], [H/128, Is/128]
};

namespace detail {
class MoELayerImpl;
}

// Per-stage times of the last forward(), in microseconds, when the layer
// was created with Options.profile (all_to_all.profile) on a GPU backend.
struct MoEStageTimes {
  double quantize_us = 0, router_us = 0, dispatch_send_us = 0, shared_expert_us = 0,
         dispatch_recv_us = 0, gemm1_us = 0, silu_mul_us = 0, gemm2_us = 0, combine_send_us = 0,
         combine_recv_us = 0, total_us = 0;
};

class MoELayer {
 public:
  // Collective over the ranks of `bootstrap`: creates the AllToAll(s) and
  // allocates the weights and workspaces. GPU backends use the current CUDA
  // device.
  //
  // share_with: another layer whose AllToAll(s), expert kernels and
  // workspaces this one uses too, allocating only its weights (no
  // collective then: every rank passes one alike). For layers that run one
  // after another on one stream, as a model's do: nothing in them outlives
  // a forward(). It must have the same shapes (hidden_size, experts, top-k,
  // intermediate sizes), max_tokens, overlap, cuda_graphs, dp_size, backend
  // and ranks (InvalidArgument naming the field otherwise). The scratch
  // lives as long as any layer using it: share_with may go first.
  static std::unique_ptr<MoELayer> create(const MoEModelConfig& model,
                                          const MoELayerOptions& options, Bootstrap& bootstrap,
                                          const MoELayer* share_with = nullptr);
  ~MoELayer();
  MoELayer(const MoELayer&) = delete;
  MoELayer& operator=(const MoELayer&) = delete;

  const MoEModelConfig& model() const;
  const MoELayerOptions& options() const;
  int rank() const;
  int world_size() const;
  int num_local_experts() const;

  // Copies this rank's weights in (checks every shape and dtype, naming the
  // field). Must be called (or load_checkpoint) before forward().
  void set_weights(const MoEWeights& w);
  // Reads layer `layer_index`'s router, this rank's experts and the shared
  // experts from a Hugging Face checkpoint directory (*.safetensors, with or
  // without model.safetensors.index.json), fp8 with weight_scale_inv or
  // bf16. A missing tensor, a wrong shape or dtype throws InvalidArgument
  // naming the tensor and the file.
  void load_checkpoint(const std::string& directory, int layer_index);

  //   out     [m', H] bf16 (m' <= T rows; rows >= m untouched)
  //   x       [m', H] bf16, rows contiguous
  //   bound_m [1] int32: m, device memory (host for the host backends)
  // num_tokens: what the host knows of m (an upper bound), to pick the
  // overlap mode (from num_tokens itself: pass one value on every rank, as
  // the ranks must agree on it) and the CUDA-graph bucket (at most x's
  // rows); 0: x's rows.
  void forward(const Tensor& out, const Tensor& x, const Tensor& bound_m,
               cudaStream_t stream = nullptr, int64_t num_tokens = 0);

  // The layer in stages, for a caller that interleaves two micro-batches
  // with work of its own (a model's pipeline across attention and MoE, seed
  // article 002: one micro-batch's transfers under the other's compute).
  // Micro-batch `part` (0 or 1) runs on its own AllToAll, which the layer
  // has with overlap micro-batch, or auto where moe_auto_micro_batches and
  // max_tokens >= micro_batch_min_tokens; it has at most ceil(T / 2) rows
  // (part 0) or floor(T / 2) (part 1). out, x and bound_m as forward()'s:
  //   stage_begin(part, out, x, bound_m): quantize, route, dispatch send,
  //     the shared expert (out = its output for the rows < m);
  //   stage_middle(part): dispatch receive, the routed experts, combine send;
  //   stage_end(part): combine receive (out += the routed experts' sum).
  // A micro-batch's three calls in this order on one stream, x, out and
  // bound_m untouched until its stage_end; the two micro-batches' calls may
  // interleave in any order, and so may those of layers sharing a scratch
  // (share_with) as long as no two hold the same part at once. The calls
  // run eagerly (the caller may capture them in its own CUDA graph);
  // forward() refuses to run while a part is held. InvalidArgument naming
  // the part and what was expected on a call out of order.
  void stage_begin(int part, const Tensor& out, const Tensor& x, const Tensor& bound_m,
                   cudaStream_t stream = nullptr);
  void stage_middle(int part, cudaStream_t stream = nullptr);
  void stage_end(int part, cudaStream_t stream = nullptr);

  // The router alone: indices [m', k] int32 and weights [m', k] fp32 for the
  // rows < m, as dispatch takes them.
  void route(const Tensor& indices, const Tensor& weights, const Tensor& x, const Tensor& bound_m,
             cudaStream_t stream = nullptr);

  // The overlap mode forward() uses for `num_tokens` tokens.
  MoEOverlap overlap_for(int64_t num_tokens) const;
  // Waits and throws what the AllToAll or the expert kernels flagged.
  void check(cudaStream_t stream = nullptr);
  // The stages of the last forward() (waits for it); zeros without profile.
  MoEStageTimes stage_times();

 private:
  explicit MoELayer(std::unique_ptr<detail::MoELayerImpl> impl);
  std::unique_ptr<detail::MoELayerImpl> impl_;
};

}  // namespace moelink
