// A build without nlohmann/json (CMake did not find nlohmann/json.hpp):
// reading config.json and safetensors checkpoints (the MoE layer's and the
// attention's) says why it cannot.
#include "attention/mla_checkpoint.h"
#include "layer/safetensors.h"
#include "moelink/model.h"
#include "moelink/errors.h"
#include "moelink/moe_layer.h"

namespace moelink {

namespace {
[[noreturn]] void no_json(const char* what) {
  throw InvalidArgument(std::string("moelink: ") + what +
                        " needs nlohmann/json, which this build did not find (apt-get install "
                        "nlohmann-json3-dev, or set MOELINK_EXTRA_INCLUDE_DIR, and rebuild)");
}
}  // namespace

MoEModelConfig MoEModelConfig::from_hf_config_json(const std::string&) {
  no_json("MoEModelConfig::from_hf_config_json");
}

MLAConfig MLAConfig::from_hf_config_json(const std::string&) { no_json("MLAConfig::from_hf_config_json"); }
ModelConfig ModelConfig::from_hf_config_json(const std::string&) { no_json("ModelConfig::from_hf_config_json"); }

namespace detail::attention {
HostCheckpointTensors read_mla_tensors(const std::string&, int) { no_json("MLAAttention.load_checkpoint"); }
}  // namespace detail::attention

namespace detail::layer {
SafetensorsDir::SafetensorsDir(const std::string&) { no_json("MoELayer.load_checkpoint"); }
const SafetensorEntry* SafetensorsDir::find(const std::string&) const { return nullptr; }
void SafetensorsDir::read(const SafetensorEntry&, void*) const {}
void SafetensorsDir::read(const SafetensorEntry&, uint64_t, uint64_t, void*) const {}
void SafetensorsDir::read_header(const std::string&) {}
}  // namespace detail::layer

}  // namespace moelink
