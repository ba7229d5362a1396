// One MoE layer's weights for one rank, read from a Hugging Face checkpoint
// (safetensors.h) into host memory in the layer's format: the router as
// stored (bf16 or fp32), the local experts' and shared experts' projections
// as fp8 with 128 x 128 block scales (bf16 / fp16 / fp32 projections are
// quantized on the way, layer/block_quant.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layer/safetensors.h"
#include "moelink/moe_layer.h"

namespace moelink::detail::layer {

struct HostLayerWeights {
  std::vector<char> gate;  // [E, H] of gate_dtype
  DType gate_dtype = DType::kBFloat16;
  std::vector<float> gate_bias;  // [E] or empty
  std::vector<uint8_t> w13, w2, shared_w13, shared_w2;
  std::vector<float> w13_scale, w2_scale, shared_w13_scale, shared_w2_scale;
  // Views for MoELayer::set_weights (host memory).
  MoEWeights view(const MoEModelConfig& m, int num_local_experts);
};

// One MLP's gate_proj, up_proj and down_proj (under `prefix`, e.g.
// "model.layers.0.mlp.") as fp8 blocks: w13 [2I, H] (gate rows, then up),
// w2 [H, I], with their [*/128, */128] scales. `caller` names the public
// call in messages.
struct HostMlpWeights {
  std::vector<uint8_t> w13, w2;
  std::vector<float> w13_scale, w2_scale;
};
HostMlpWeights read_mlp_weights(const SafetensorsDir& dir, const std::string& prefix, int64_t I,
                                int64_t H, const std::string& caller);

// A BF16, F16 or F32 tensor of exactly `shape`, as floats.
std::vector<float> read_float_tensor(const SafetensorsDir& dir, const std::string& name,
                                     const std::vector<int64_t>& shape, const std::string& caller);

// Layer `layer`'s router, experts rank * L .. rank * L + L - 1 and shared
// experts. Throws InvalidArgument naming the tensor and the file (or the
// files searched) for a missing tensor, a wrong shape or dtype.
HostLayerWeights read_layer_weights(const SafetensorsDir& dir, const MoEModelConfig& m, int layer,
                                    int rank, int num_local_experts);

}  // namespace moelink::detail::layer
