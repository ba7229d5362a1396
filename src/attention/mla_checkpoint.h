// One attention layer's tensors of a Hugging Face checkpoint, read into host
// memory as MLAWeights views (model.layers.N.input_layernorm and
// model.layers.N.self_attn.*; fp8 with weight_scale_inv, or bf16 / fp16 /
// fp32). Shapes are checked by set_weights, which names the field; a missing
// tensor throws InvalidArgument naming it and the files searched.
#pragma once

#include <string>
#include <vector>

#include "moelink/attention.h"

namespace moelink::detail::attention {

struct HostCheckpointTensors {
  std::vector<std::vector<char>> storage;
  MLAWeights weights;  // views into storage
};

HostCheckpointTensors read_mla_tensors(const std::string& directory, int layer);

}  // namespace moelink::detail::attention
