// moelink-plan: the model a deployment serves (decode phase).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace moelink::plan {

// Thrown for bad input to the planner: unknown names, bad files, layouts that
// do not fit. The message says what is wrong and, where it can, what is valid.
struct PlanError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class AttentionKind { kMLA, kGQA };

// Architecture numbers of a Mixture-of-Experts transformer. Read from a Hugging
// Face config.json (the built-in model profiles use the same format).
struct ModelSpec {
  std::string name;
  int64_t hidden = 0;
  int64_t num_layers = 0;        // transformer layers of the main model
  int64_t num_dense_layers = 0;  // leading layers with a dense MLP instead of MoE
  int64_t vocab = 0;
  bool tied_embeddings = false;
  AttentionKind attention = AttentionKind::kGQA;
  int64_t num_heads = 0;
  // GQA
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  // MLA (DeepSeek-V3 style; decode runs the weight-absorbed form)
  int64_t q_lora_rank = 0;  // 0: q projected directly from hidden
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // MLP / MoE
  int64_t dense_intermediate = 0;
  int64_t moe_intermediate = 0;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t num_shared_experts = 0;
  int64_t mtp_layers = 0;  // next-token-prediction modules shipped with the model
  // Storage
  double weight_bytes = 2;   // per parameter of the linear layers (1 = fp8)
  int64_t quant_block = 0;   // fp8 block size (128 -> one fp32 scale per 128x128 tile)
  double kv_bytes = 2;       // per KV cache element
  double embed_bytes = 2;    // embeddings and lm_head

  int64_t num_moe_layers() const { return num_layers - num_dense_layers; }
  // KV cache bytes one token occupies on one GPU holding all heads (70,272 for DeepSeek-V3).
  double kv_bytes_per_token() const;
  // Parameters of one routed expert (gate, up, down).
  double expert_params() const { return 3.0 * hidden * moe_intermediate; }
  double attention_params() const;  // one layer, all heads
  double total_params() const;      // main model, without MTP modules
  double activated_params() const;  // per token
};

// Parses a Hugging Face config.json (or a built-in profile in that format).
// `fallback_name` names the model when the file has no "name" field.
ModelSpec model_from_json_text(const std::string& text, const std::string& fallback_name);

}  // namespace moelink::plan
