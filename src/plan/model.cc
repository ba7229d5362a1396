#include "moelink/plan/model.h"

#include <nlohmann/json.hpp>

namespace moelink::plan {
namespace {
using nlohmann::json;

int64_t get_int(const json& j, std::initializer_list<const char*> keys, int64_t dflt) {
  for (const char* k : keys) {
    auto it = j.find(k);
    if (it != j.end() && it->is_number()) return it->get<int64_t>();
  }
  return dflt;
}
}  // namespace

double ModelSpec::kv_bytes_per_token() const {
  if (attention == AttentionKind::kMLA)
    return double(num_layers) * double(kv_lora_rank + qk_rope_head_dim) * kv_bytes;
  return double(num_layers) * 2.0 * double(num_kv_heads) * double(head_dim) * kv_bytes;
}

double ModelSpec::attention_params() const {
  const double h = double(hidden);
  if (attention == AttentionKind::kMLA) {
    const double qk = double(qk_nope_head_dim + qk_rope_head_dim);
    const double q = q_lora_rank > 0 ? h * q_lora_rank + double(q_lora_rank) * num_heads * qk
                                     : h * num_heads * qk;
    const double kv_a = h * double(kv_lora_rank + qk_rope_head_dim);
    const double kv_b = double(kv_lora_rank) * num_heads * double(qk_nope_head_dim + v_head_dim);
    const double o = double(num_heads) * v_head_dim * h;
    return q + kv_a + kv_b + o;
  }
  return h * head_dim * double(num_heads + 2 * num_kv_heads) + double(num_heads) * head_dim * h;
}

double ModelSpec::total_params() const {
  const double moe = double(num_moe_layers()) *
                     (double(num_experts + num_shared_experts) * expert_params() + double(hidden) * num_experts);
  const double dense = double(num_dense_layers) * 3.0 * hidden * dense_intermediate;
  const double emb = double(vocab) * hidden * (tied_embeddings ? 1 : 2);
  return double(num_layers) * attention_params() + moe + dense + emb;
}

double ModelSpec::activated_params() const {
  const double moe = double(num_moe_layers()) * double(experts_per_token + num_shared_experts) * expert_params();
  const double dense = double(num_dense_layers) * 3.0 * hidden * dense_intermediate;
  return double(num_layers) * attention_params() + moe + dense + double(vocab) * hidden;
}

ModelSpec model_from_json_text(const std::string& text, const std::string& fallback_name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw PlanError("model '" + fallback_name + "': not valid JSON: " + e.what());
  }
  if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];
  ModelSpec m;
  m.name = j.value("name", fallback_name);
  m.hidden = get_int(j, {"hidden_size", "dim"}, 0);
  m.num_layers = get_int(j, {"num_hidden_layers", "n_layers"}, 0);
  m.vocab = get_int(j, {"vocab_size"}, 0);
  m.tied_embeddings = j.value("tie_word_embeddings", false);
  m.num_heads = get_int(j, {"num_attention_heads", "n_heads"}, 0);
  m.num_kv_heads = get_int(j, {"num_key_value_heads"}, m.num_heads);
  m.head_dim = get_int(j, {"head_dim"}, m.num_heads ? m.hidden / m.num_heads : 0);
  m.kv_lora_rank = get_int(j, {"kv_lora_rank"}, 0);
  if (m.kv_lora_rank > 0) {
    m.attention = AttentionKind::kMLA;
    m.q_lora_rank = get_int(j, {"q_lora_rank"}, 0);
    m.qk_nope_head_dim = get_int(j, {"qk_nope_head_dim"}, 128);
    m.qk_rope_head_dim = get_int(j, {"qk_rope_head_dim"}, 64);
    m.v_head_dim = get_int(j, {"v_head_dim"}, 128);
  }
  m.dense_intermediate = get_int(j, {"intermediate_size"}, 0);
  m.num_experts = get_int(j, {"n_routed_experts", "num_experts", "num_local_experts"}, 0);
  m.experts_per_token = get_int(j, {"num_experts_per_tok", "moe_topk"}, 0);
  m.moe_intermediate = get_int(j, {"moe_intermediate_size"}, m.dense_intermediate);
  m.num_shared_experts = get_int(j, {"n_shared_experts", "num_shared_experts"}, 0);
  // DeepSeek: first_k_dense_replace; Qwen3-MoE: mlp_only_layers / decoder_sparse_step (1 = all MoE).
  m.num_dense_layers = get_int(j, {"first_k_dense_replace"}, 0);
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array())
    m.num_dense_layers += int64_t(j["mlp_only_layers"].size());
  m.mtp_layers = get_int(j, {"num_nextn_predict_layers"}, 0);
  const std::string dtype = j.value("torch_dtype", std::string("bfloat16"));
  m.weight_bytes = dtype == "float32" ? 4 : 2;
  if (j.contains("quantization_config") && j["quantization_config"].is_object()) {
    const auto& q = j["quantization_config"];
    const std::string method = q.value("quant_method", std::string());
    const std::string fmt = q.value("fmt", std::string());
    if (method == "fp8" || fmt.rfind("e4m3", 0) == 0) {
      m.weight_bytes = 1;
      if (q.contains("weight_block_size") && q["weight_block_size"].is_array() &&
          !q["weight_block_size"].empty())
        m.quant_block = q["weight_block_size"][0].get<int64_t>();
    }
  }
  if (j.contains("weight_bytes")) m.weight_bytes = j["weight_bytes"].get<double>();
  if (j.contains("kv_bytes")) m.kv_bytes = j["kv_bytes"].get<double>();
  std::string missing;
  auto need = [&](int64_t v, const char* key) {
    if (v <= 0) missing += std::string(missing.empty() ? "" : ", ") + key;
  };
  need(m.hidden, "hidden_size");
  need(m.num_layers, "num_hidden_layers");
  need(m.vocab, "vocab_size");
  need(m.num_heads, "num_attention_heads");
  need(m.num_experts, "n_routed_experts/num_experts/num_local_experts");
  need(m.experts_per_token, "num_experts_per_tok");
  need(m.moe_intermediate, "moe_intermediate_size/intermediate_size");
  if (!missing.empty())
    throw PlanError("model '" + m.name + "': not a Mixture-of-Experts config, missing or zero: " + missing);
  if (m.experts_per_token > m.num_experts)
    throw PlanError("model '" + m.name + "': num_experts_per_tok > number of experts");
  if (m.num_dense_layers >= m.num_layers) throw PlanError("model '" + m.name + "': no MoE layers");
  return m;
}

}  // namespace moelink::plan
