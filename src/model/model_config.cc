// ModelConfig::from_hf_config_json: DeepseekV3Config's fields, the
// attention's and the MoE layer's parsed by their own readers (needs
// nlohmann/json; core/json_unavailable.cc stands in without it).
#include "core/hf_config_json.h"
#include "moelink/model.h"

namespace moelink {

ModelConfig ModelConfig::from_hf_config_json(const std::string& json_text) {
  const nlohmann::json j = detail::parse_hf_config(json_text, "ModelConfig");
  auto integer = [&](const char* key, int64_t fallback, bool required) {
    return static_cast<int64_t>(
        detail::hf_number(j, {key}, static_cast<double>(fallback), required, "ModelConfig"));
  };
  ModelConfig c;
  c.attention = MLAConfig::from_hf_config_json(json_text);
  c.moe = MoEModelConfig::from_hf_config_json(json_text);
  c.vocab_size = static_cast<int>(integer("vocab_size", 0, true));
  c.num_hidden_layers = static_cast<int>(integer("num_hidden_layers", 0, true));
  c.first_k_dense_replace = static_cast<int>(integer("first_k_dense_replace", 0, false));
  c.intermediate_size = static_cast<int>(integer("intermediate_size", 0, c.first_k_dense_replace > 0));
  c.num_nextn_predict_layers = static_cast<int>(integer("num_nextn_predict_layers", 0, false));
  c.rms_norm_eps = detail::hf_number(j, {"rms_norm_eps"}, c.rms_norm_eps, false, "ModelConfig");
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.validate();
  return c;
}

}  // namespace moelink
