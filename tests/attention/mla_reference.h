// The tests' reference of MLA attention: Hugging Face's DeepseekV3Attention
// (MHA form, no absorption, all heads) in fp64 on the dequantized fp8
// weights, written from its definition and independent of src/attention.
// Also the tests' random model.
#pragma once

#include <cstdint>
#include <vector>

#include "moelink/attention.h"

namespace moelink_test {

// All weights of one attention layer, fp8 in 128 x 128 blocks (as a
// checkpoint holds them), and their dequantized values for the reference.
struct MLATestWeights {
  moelink::MLAConfig config;
  std::vector<float> input_layernorm, q_a_layernorm, kv_a_layernorm;  // empty input_layernorm: none
  struct Projection {
    int64_t rows = 0, cols = 0;
    std::vector<uint8_t> q;
    std::vector<float> scale;     // [ceil(rows/128), cols/128]
    std::vector<double> w;        // dequantized [rows, cols]
  };
  Projection q_a, kv_a, q_b, kv_b, o;
  // Views for MLAAttention::set_weights (host memory).
  moelink::MLAWeights view();
};

MLATestWeights random_mla_weights(const moelink::MLAConfig& c, uint64_t seed, bool input_norm);

// Which data flow the reference follows:
//   kExact  HF's definition in fp64 on the dequantized weights;
//   kHF     the same with the projections' common inputs quantized to fp8
//           per 1 x 128 group as the module's GEMMs take them (x, q_a's
//           normed output, the attention output).
enum class RefFlow { kExact, kHF };

// Outputs of a request whose tokens are x [L, D] (bf16 bit patterns) at
// positions 0..L-1, for the rows at positions [from, L): [L - from, D].
std::vector<double> ref_mla(const MLATestWeights& w, const uint16_t* x, int64_t L, int64_t from,
                            RefFlow flow);

// Token `pos`'s cache row [R + Dr] as the module stores it (the latent after
// kv_a_layernorm, then the roped rotary key dims, DeepSeek's pair order),
// before the final bf16 rounding.
std::vector<double> ref_cache_row(const MLATestWeights& w, const uint16_t* x_row, int64_t pos);

}  // namespace moelink_test
