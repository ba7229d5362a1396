// MLAConfig::from_hf_config_json and MLAAttention::load_checkpoint: the
// attention's fields of a Hugging Face config.json and its tensors in a
// safetensors checkpoint (needs nlohmann/json, as the MoE layer's reader).
#include <nlohmann/json.hpp>

#include <cstring>
#include <vector>

#include "attention/mla_checkpoint.h"
#include "core/float_convert.h"
#include "core/hf_config_json.h"
#include "layer/safetensors.h"
#include "moelink/attention.h"
#include "moelink/errors.h"

namespace moelink {

MLAConfig MLAConfig::from_hf_config_json(const std::string& json_text) {
  const nlohmann::json j = detail::parse_hf_config(json_text, "MLAConfig");
  auto number = [&](const nlohmann::json& o, const char* key, double fallback, bool required) {
    return detail::hf_number(o, {key}, fallback, required, "MLAConfig");
  };
  MLAConfig c;
  c.hidden_size = static_cast<int>(number(j, "hidden_size", 0, true));
  c.num_attention_heads = static_cast<int>(number(j, "num_attention_heads", 0, true));
  if (!j.contains("q_lora_rank") || !j["q_lora_rank"].is_number())
    throw InvalidArgument("moelink: MLAConfig: config.json has no q_lora_rank (models without the "
                          "query compression, e.g. DeepSeek-V2-Lite, are not supported)");
  c.q_lora_rank = static_cast<int>(number(j, "q_lora_rank", 0, true));
  c.kv_lora_rank = static_cast<int>(number(j, "kv_lora_rank", 0, true));
  c.qk_nope_head_dim = static_cast<int>(number(j, "qk_nope_head_dim", 128, false));
  c.qk_rope_head_dim = static_cast<int>(number(j, "qk_rope_head_dim", 64, false));
  c.v_head_dim = static_cast<int>(number(j, "v_head_dim", 128, false));
  c.rms_norm_eps = number(j, "rms_norm_eps", 1e-6, false);
  c.rope_theta = number(j, "rope_theta", 10000.0, false);
  c.rope_interleave = j.value("rope_interleave", true);
  // config.json's rope_scaling (DeepSeek's own files), or transformers 5's
  // rope_parameters, which also carries rope_theta.
  const char* rope_key = j.contains("rope_parameters") && j["rope_parameters"].is_object()
                             ? "rope_parameters"
                             : "rope_scaling";
  if (j.contains(rope_key) && j[rope_key].is_object()) {
    const nlohmann::json& r = j[rope_key];
    c.rope_theta = number(r, "rope_theta", c.rope_theta, false);
    const std::string type = r.value("type", r.value("rope_type", std::string()));
    if (type != "default" && !type.empty()) {
      c.rope_scaling.type = type;
      c.rope_scaling.factor = number(r, "factor", 1.0, false);
      c.rope_scaling.original_max_position_embeddings = static_cast<int64_t>(
          number(r, "original_max_position_embeddings", number(j, "max_position_embeddings", 4096, false), false));
      c.rope_scaling.beta_fast = number(r, "beta_fast", 32.0, false);
      c.rope_scaling.beta_slow = number(r, "beta_slow", 1.0, false);
      // HF reads a missing mscale / mscale_all_dim as None (0 here: not given).
      c.rope_scaling.mscale = number(r, "mscale", 0.0, false);
      c.rope_scaling.mscale_all_dim = number(r, "mscale_all_dim", 0.0, false);
    }
  }
  c.validate();
  return c;
}

namespace detail::attention {

namespace {

DType dtype_of(const layer::SafetensorEntry& e, const std::string& name) {
  if (e.dtype == "F8_E4M3") return DType::kFloat8E4M3;
  if (e.dtype == "BF16") return DType::kBFloat16;
  if (e.dtype == "F32") return DType::kFloat32;
  if (e.dtype == "F16") return DType::kFloat16;  // widened to fp32 below
  throw InvalidArgument("moelink: MLAAttention.load_checkpoint: tensor " + name + " in " + e.file +
                        " has dtype " + e.dtype + ", expected F8_E4M3, BF16, F16 or F32");
}

}  // namespace

HostCheckpointTensors read_mla_tensors(const std::string& directory, int layer) {
  const layer::SafetensorsDir dir(directory);
  HostCheckpointTensors out;
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  auto read = [&](const std::string& name, bool required) -> Tensor {
    const layer::SafetensorEntry* e = dir.find(name);
    if (e == nullptr) {
      if (!required) return {};
      std::string files;
      for (const std::string& f : dir.files()) files += (files.empty() ? "" : ", ") + f;
      throw InvalidArgument("moelink: MLAAttention.load_checkpoint: tensor " + name +
                            " is in none of the files of " + directory + " (" + files + ")");
    }
    DType t = dtype_of(*e, name);
    if (e->shape.empty() || e->shape.size() > 2)
      throw InvalidArgument("moelink: MLAAttention.load_checkpoint: tensor " + name + " in " + e->file +
                            " has " + std::to_string(e->shape.size()) + " dimensions, expected 1 or 2");
    std::vector<char>& bytes = out.storage.emplace_back(e->bytes);
    dir.read(*e, bytes.data());
    if (t == DType::kFloat16) {  // set_weights takes bf16 or fp32
      std::vector<char> wide(bytes.size() * 2);
      for (size_t i = 0; i < bytes.size() / 2; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        const float f = f16_to_f32(h);
        std::memcpy(wide.data() + 4 * i, &f, 4);
      }
      bytes.swap(wide);
      t = DType::kFloat32;
    }
    Tensor v;
    v.data = bytes.data();
    v.dtype = t;
    v.ndim = static_cast<int>(e->shape.size());
    for (int d = 0; d < v.ndim; ++d) v.shape[d] = e->shape[d];
    v.stride[v.ndim - 1] = 1;
    if (v.ndim == 2) v.stride[0] = v.shape[1];
    return v;
  };
  out.storage.reserve(16);  // the views point into it: no reallocation
  MLAWeights& w = out.weights;
  w.input_layernorm = read(prefix + "input_layernorm.weight", false);
  const std::string a = prefix + "self_attn.";
  auto projection = [&](const char* name, Tensor& weight, Tensor& scale) {
    weight = read(a + name + ".weight", true);
    if (weight.dtype == DType::kFloat8E4M3) scale = read(a + name + ".weight_scale_inv", true);
  };
  projection("q_a_proj", w.q_a_proj, w.q_a_proj_scale);
  w.q_a_layernorm = read(a + "q_a_layernorm.weight", true);
  projection("kv_a_proj_with_mqa", w.kv_a_proj_with_mqa, w.kv_a_proj_with_mqa_scale);
  w.kv_a_layernorm = read(a + "kv_a_layernorm.weight", true);
  projection("q_b_proj", w.q_b_proj, w.q_b_proj_scale);
  projection("kv_b_proj", w.kv_b_proj, w.kv_b_proj_scale);
  projection("o_proj", w.o_proj, w.o_proj_scale);
  return out;
}

}  // namespace detail::attention
}  // namespace moelink
