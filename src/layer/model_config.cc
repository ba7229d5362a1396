// MoEModelConfig: presets, Hugging Face config.json, checks.
#include <algorithm>
#include <cctype>
#include <sstream>

#include "moelink/errors.h"
#include "moelink/moe_layer.h"

namespace moelink {

namespace {

MoEModelConfig deepseek_like(const char* name, int experts, float scaling, int n_group,
                             int topk_group) {
  MoEModelConfig c;
  c.name = name;
  c.hidden_size = 7168;
  c.moe_intermediate_size = 2048;
  c.n_routed_experts = experts;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 8;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.scoring = ScoringFunction::kSigmoid;
  c.score_correction_bias = true;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = scaling;
  return c;
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

MoEModelConfig MoEModelConfig::deepseek_v3() { return deepseek_like("DeepSeek-V3", 256, 2.5f, 8, 4); }

MoEModelConfig MoEModelConfig::kimi_k2() { return deepseek_like("Kimi-K2", 384, 2.827f, 1, 1); }

MoEModelConfig MoEModelConfig::qwen3_235b_a22b() {
  MoEModelConfig c;
  c.name = "Qwen3-235B-A22B";
  c.hidden_size = 4096;
  c.moe_intermediate_size = 1536;
  c.n_routed_experts = 128;
  c.num_experts_per_tok = 8;
  c.scoring = ScoringFunction::kSoftmax;
  c.norm_topk_prob = true;
  return c;
}

MoEModelConfig MoEModelConfig::mixtral_8x7b() {
  MoEModelConfig c;
  c.name = "Mixtral-8x7B";
  c.hidden_size = 4096;
  c.moe_intermediate_size = 14336;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.scoring = ScoringFunction::kSoftmax;
  c.norm_topk_prob = true;  // softmax over the top-2 logits: the same weights
  c.checkpoint_naming = "mixtral";
  return c;
}

MoEModelConfig MoEModelConfig::preset(const std::string& name) {
  const std::string n = lower(name);
  if (n == "deepseek-v3" || n == "deepseek-r1") {
    MoEModelConfig c = deepseek_v3();
    c.name = n == "deepseek-r1" ? "DeepSeek-R1" : "DeepSeek-V3";
    return c;
  }
  if (n == "kimi-k2") return kimi_k2();
  if (n == "qwen3-235b-a22b") return qwen3_235b_a22b();
  if (n == "mixtral-8x7b") return mixtral_8x7b();
  throw InvalidArgument("moelink: MoEModelConfig::preset: unknown model '" + name +
                        "'; presets: deepseek-v3, deepseek-r1, kimi-k2, qwen3-235b-a22b, "
                        "mixtral-8x7b (or read a config.json with from_hf_config_json)");
}

void MoEModelConfig::validate() const {
  auto fail = [this](const char* field, int64_t v, const std::string& rule) {
    throw InvalidArgument("moelink: MoEModelConfig(" + name + ")." + field + " = " +
                          std::to_string(v) + " " + rule);
  };
  if (hidden_size <= 0 || hidden_size % 128 != 0)
    fail("hidden_size", hidden_size, "must be a positive multiple of 128");
  if (moe_intermediate_size <= 0 || moe_intermediate_size % 128 != 0)
    fail("moe_intermediate_size", moe_intermediate_size, "must be a positive multiple of 128");
  if (n_routed_experts < 1 || n_routed_experts > 1024)
    fail("n_routed_experts", n_routed_experts, "must be in [1, 1024]");
  if (n_shared_experts < 0 || n_shared_experts > 16)
    fail("n_shared_experts", n_shared_experts, "must be in [0, 16]");
  if (num_experts_per_tok < 1 || num_experts_per_tok > std::min(16, n_routed_experts))
    fail("num_experts_per_tok", num_experts_per_tok,
         "must be in [1, min(16, n_routed_experts = " + std::to_string(n_routed_experts) + ")]");
  if (n_group < 1 || n_routed_experts % n_group != 0 || n_group > 32)
    fail("n_group", n_group,
         "must be in [1, 32] and divide n_routed_experts = " + std::to_string(n_routed_experts));
  if (n_group > 1 && n_routed_experts / n_group < 2)
    fail("n_group", n_group, "leaves fewer than 2 experts per group (a group scores its best two)");
  if (topk_group < 1 || topk_group > n_group)
    fail("topk_group", topk_group, "must be in [1, n_group = " + std::to_string(n_group) + "]");
  if (n_group > 1 && topk_group * (n_routed_experts / n_group) < num_experts_per_tok)
    fail("topk_group", topk_group,
         "leaves fewer experts than num_experts_per_tok = " + std::to_string(num_experts_per_tok));
  if (!(routed_scaling_factor > 0.0f))
    throw InvalidArgument("moelink: MoEModelConfig(" + name + ").routed_scaling_factor = " +
                          std::to_string(routed_scaling_factor) + " must be positive");
  if (checkpoint_naming != "deepseek" && checkpoint_naming != "mixtral")
    throw InvalidArgument("moelink: MoEModelConfig(" + name + ").checkpoint_naming = '" +
                          checkpoint_naming + "' must be 'deepseek' or 'mixtral'");
}

std::string MoEModelConfig::to_string() const {
  std::ostringstream os;
  os << "MoEModelConfig(" << name << ": hidden_size=" << hidden_size
     << ", moe_intermediate_size=" << moe_intermediate_size << ", n_routed_experts=" << n_routed_experts
     << ", n_shared_experts=" << n_shared_experts << ", num_experts_per_tok=" << num_experts_per_tok
     << ", n_group=" << n_group << ", topk_group=" << topk_group
     << ", scoring=" << (scoring == ScoringFunction::kSigmoid ? "sigmoid" : "softmax")
     << ", score_correction_bias=" << score_correction_bias
     << ", norm_topk_prob=" << norm_topk_prob << ", routed_scaling_factor=" << routed_scaling_factor
     << ")";
  return os.str();
}

bool moe_auto_micro_batches(Backend backend, int world_size) {
  // Across nodes a micro-batch's transfer hides under the other's compute;
  // on one node the transfer is short and the second read of every expert's
  // weights is not (docs/moe_layer.md).
  const bool may_cross_nodes =
      backend == Backend::kNVSHMEM || backend == Backend::kInternode || backend == Backend::kInternodeCPU;
  return may_cross_nodes && world_size > 1;
}

const char* moe_overlap_name(MoEOverlap m) {
  switch (m) {
    case MoEOverlap::kAuto: return "auto";
    case MoEOverlap::kNone: return "none";
    case MoEOverlap::kDispatchOverlap: return "dispatch-overlap";
    case MoEOverlap::kMicroBatch: return "micro-batch";
  }
  return "?";
}

}  // namespace moelink
