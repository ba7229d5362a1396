// MoEModelConfig::from_hf_config_json (needs nlohmann/json; a build without
// it has core/json_unavailable.cc instead).
#include "core/hf_config_json.h"
#include "moelink/errors.h"
#include "moelink/moe_layer.h"

namespace moelink {

MoEModelConfig MoEModelConfig::from_hf_config_json(const std::string& json_text) {
  const nlohmann::json j = detail::parse_hf_config(json_text, "MoEModelConfig");
  auto number = [&](std::initializer_list<const char*> keys, double fallback, bool required) {
    return detail::hf_number(j, keys, fallback, required, "MoEModelConfig");
  };
  const std::string type = j.value("model_type", std::string());
  MoEModelConfig c;
  c.name = j.value("name", type.empty() ? std::string("model") : type);
  c.hidden_size = static_cast<int>(number({"hidden_size"}, 0, true));
  const bool mixtral = type == "mixtral";
  c.moe_intermediate_size = static_cast<int>(
      mixtral ? number({"intermediate_size"}, 0, true) : number({"moe_intermediate_size"}, 0, true));
  c.n_routed_experts =
      static_cast<int>(number({"n_routed_experts", "num_experts", "num_local_experts"}, 0, true));
  c.n_shared_experts = static_cast<int>(number({"n_shared_experts"}, 0, false));
  c.num_experts_per_tok = static_cast<int>(number({"num_experts_per_tok"}, 0, true));
  c.n_group = static_cast<int>(number({"n_group"}, 1, false));
  c.topk_group = static_cast<int>(number({"topk_group"}, 1, false));
  const std::string scoring =
      j.value("scoring_func", std::string(type.rfind("deepseek_v3", 0) == 0 || type == "kimi_k2"
                                              ? "sigmoid"
                                              : "softmax"));
  if (scoring == "sigmoid")
    c.scoring = ScoringFunction::kSigmoid;
  else if (scoring == "softmax")
    c.scoring = ScoringFunction::kSoftmax;
  else
    throw InvalidArgument("moelink: MoEModelConfig: scoring_func = '" + scoring +
                          "' must be 'sigmoid' or 'softmax'");
  c.score_correction_bias = j.value("topk_method", std::string()) == "noaux_tc" ||
                            type == "deepseek_v3" || type == "kimi_k2";
  c.norm_topk_prob = mixtral ? true : j.value("norm_topk_prob", false);
  c.routed_scaling_factor = static_cast<float>(number({"routed_scaling_factor"}, 1.0, false));
  c.checkpoint_naming = mixtral ? "mixtral" : "deepseek";
  c.validate();
  return c;
}

}  // namespace moelink
