// MLAConfig: presets (from the models' config.json), the rules every field
// follows, and the softmax scale with YaRN's attention factor.
#include <cmath>
#include <sstream>

#include "attention/rope.h"
#include "moelink/attention.h"
#include "moelink/errors.h"

namespace moelink {

namespace {

[[noreturn]] void bad_field(const char* field, const std::string& value, const std::string& rule) {
  throw InvalidArgument(std::string("moelink: MLAConfig.") + field + " = " + value + " " + rule);
}

void require_multiple_of_128(const char* field, int v) {
  if (v < 128 || v % 128 != 0 || v > (1 << 20))
    bad_field(field, std::to_string(v), "must be a positive multiple of 128 (at most 2^20)");
}

}  // namespace

MLAConfig MLAConfig::deepseek_v3() {
  MLAConfig c;
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.rope_scaling = {"yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  return c;
}

MLAConfig MLAConfig::kimi_k2() {
  MLAConfig c = deepseek_v3();
  c.num_attention_heads = 64;
  c.rope_theta = 50000.0;
  c.rope_scaling = {"yarn", 32.0, 4096, 1.0, 1.0, 1.0, 1.0};
  return c;
}

MLAConfig MLAConfig::preset(const std::string& name) {
  if (name == "deepseek-v3" || name == "deepseek-r1") return deepseek_v3();
  if (name == "kimi-k2") return kimi_k2();
  throw InvalidArgument("moelink: MLAConfig.preset: '" + name +
                        "' is not a preset (deepseek-v3, deepseek-r1, kimi-k2)");
}

double MLAConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling.type == "yarn" && rope_scaling.mscale_all_dim != 0.0) {
    const double m = detail::attention::yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

void MLAConfig::validate() const {
  require_multiple_of_128("hidden_size", hidden_size);
  if (num_attention_heads < 1 || num_attention_heads > 1024)
    bad_field("num_attention_heads", std::to_string(num_attention_heads), "must be in [1, 1024]");
  require_multiple_of_128("q_lora_rank", q_lora_rank);
  require_multiple_of_128("kv_lora_rank", kv_lora_rank);
  require_multiple_of_128("qk_nope_head_dim", qk_nope_head_dim);
  require_multiple_of_128("v_head_dim", v_head_dim);
  if (qk_rope_head_dim < 2 || qk_rope_head_dim > 256 || qk_rope_head_dim % 2 != 0)
    bad_field("qk_rope_head_dim", std::to_string(qk_rope_head_dim), "must be even, in [2, 256]");
  if (!(rms_norm_eps > 0.0) || rms_norm_eps > 1.0)
    bad_field("rms_norm_eps", std::to_string(rms_norm_eps), "must be in (0, 1]");
  if (!(rope_theta > 1.0)) bad_field("rope_theta", std::to_string(rope_theta), "must be > 1");
  const RopeScaling& r = rope_scaling;
  if (r.type.empty()) return;
  if (r.type != "yarn")
    bad_field("rope_scaling.type", "'" + r.type + "'", "must be 'yarn' or empty (plain RoPE)");
  if (!(r.factor >= 1.0))
    bad_field("rope_scaling.factor", std::to_string(r.factor), "must be >= 1");
  if (r.original_max_position_embeddings < 1)
    bad_field("rope_scaling.original_max_position_embeddings",
              std::to_string(r.original_max_position_embeddings), "must be >= 1");
  if (!(r.beta_fast > 0.0) || !(r.beta_slow > 0.0))
    bad_field(r.beta_fast > 0.0 ? "rope_scaling.beta_slow" : "rope_scaling.beta_fast",
              std::to_string(r.beta_fast > 0.0 ? r.beta_slow : r.beta_fast), "must be > 0");
}

std::string MLAConfig::to_string() const {
  std::ostringstream os;
  os << "MLAConfig(hidden_size=" << hidden_size << ", num_attention_heads=" << num_attention_heads
     << ", q_lora_rank=" << q_lora_rank << ", kv_lora_rank=" << kv_lora_rank
     << ", qk_nope_head_dim=" << qk_nope_head_dim << ", qk_rope_head_dim=" << qk_rope_head_dim
     << ", v_head_dim=" << v_head_dim << ", rope_theta=" << rope_theta;
  if (!rope_scaling.type.empty())
    os << ", rope_scaling=" << rope_scaling.type << " x" << rope_scaling.factor;
  os << ")";
  return os.str();
}

}  // namespace moelink
