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

// Layer `layer`'s router, experts rank * L .. rank * L + L - 1 and shared
// experts. Throws InvalidArgument naming the tensor and the file (or the
// files searched) for a missing tensor, a wrong shape or dtype.
HostLayerWeights read_layer_weights(const SafetensorsDir& dir, const MoEModelConfig& m, int layer,
                                    int rank, int num_local_experts);

}  // namespace moelink::detail::layer
