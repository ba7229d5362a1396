// The tests' reference of a MoE layer, in fp64 from the definitions (Hugging
// Face's DeepseekV3TopkRouter / MixtralSparseMoeBlock routing, the expert MLP
// of moelink/experts.h on the layer's fp8 data flow), independent of src/.
// Also the layer's test model: weights drawn from one seed so that every rank
// holds the same model and takes its own experts' slice.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moelink/moe_layer.h"

namespace moelink_test {

// All of a model's weights (every expert), on the host.
struct LayerWeights {
  std::vector<uint16_t> gate;  // [E, H] bf16
  std::vector<float> gate_bias;  // [E] or empty
  std::vector<uint8_t> w13, w2;  // [E, 2I, H], [E, H, I] fp8
  std::vector<float> w13_scale, w2_scale;
  std::vector<uint8_t> shared_w13, shared_w2;  // [2Is, H], [H, Is] or empty
  std::vector<float> shared_w13_scale, shared_w2_scale;
  // This rank's MoEWeights views (experts rank * L .. rank * L + L - 1).
  moelink::MoEWeights view(const moelink::MoEModelConfig& m, int rank, int num_local_experts);
};
LayerWeights random_layer_weights(const moelink::MoEModelConfig& m, uint64_t seed);

struct RefRoute {
  std::vector<int> experts;     // k, best first
  std::vector<double> weights;  // k
  // Smallest gap between a chosen and a rejected candidate (the k-th and
  // (k+1)-th expert, or the topk_group-th and next group): below ~1e-5 the
  // kernels' fp32 arithmetic may choose the other way.
  double margin;
};
RefRoute ref_route(const moelink::MoEModelConfig& m, const LayerWeights& w, const uint16_t* x_bf16);

// The layer's output row for token x (bf16 [H]) as moelink computes it:
// x quantized 1x128, each chosen expert's MLP on the fp8 data flow with its
// output rounded to bf16, weighted and summed, plus the shared expert
// (rounded to bf16).
std::vector<double> ref_layer_row(const moelink::MoEModelConfig& m, const LayerWeights& w,
                                  const uint16_t* x_bf16, const RefRoute& route);

}  // namespace moelink_test
