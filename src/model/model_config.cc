// ModelConfig::from_hf_config_json: DeepseekV3Config's fields, the
// attention's and the MoE layer's parsed by their own readers (needs
// nlohmann/json; core/json_unavailable.cc stands in without it).
#include <nlohmann/json.hpp>

#include "moelink/errors.h"
#include "moelink/model.h"

namespace moelink {

ModelConfig ModelConfig::from_hf_config_json(const std::string& json_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(std::string("moelink: ModelConfig: config.json is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw InvalidArgument("moelink: ModelConfig: config.json is not a JSON object");
  if (j.contains("text_config") && j["text_config"].is_object() && !j.contains("hidden_size"))
    j = j["text_config"];
  auto integer = [&](const char* key, int64_t fallback, bool required) -> int64_t {
    if (j.contains(key) && j[key].is_number()) return j[key].get<int64_t>();
    if (required) throw InvalidArgument(std::string("moelink: ModelConfig: config.json has no ") + key);
    return fallback;
  };
  ModelConfig c;
  c.attention = MLAConfig::from_hf_config_json(json_text);
  c.moe = MoEModelConfig::from_hf_config_json(json_text);
  c.vocab_size = static_cast<int>(integer("vocab_size", 0, true));
  c.num_hidden_layers = static_cast<int>(integer("num_hidden_layers", 0, true));
  c.first_k_dense_replace = static_cast<int>(integer("first_k_dense_replace", 0, false));
  c.intermediate_size = static_cast<int>(integer("intermediate_size", 0, c.first_k_dense_replace > 0));
  c.num_nextn_predict_layers = static_cast<int>(integer("num_nextn_predict_layers", 0, false));
  if (j.contains("rms_norm_eps") && j["rms_norm_eps"].is_number()) c.rms_norm_eps = j["rms_norm_eps"].get<double>();
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.validate();
  return c;
}

}  // namespace moelink
