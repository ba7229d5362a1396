// FlashInfer's Hopper prefill kernel (FA3: wgmma and TMA; FlashInfer 0.7.4's
// C++ headers, header-only like CUTLASS) for the prefill in MHA form: one
// request's query rows against one range of its keys, each head its own keys
// and values (kv_b_proj's expansion of the latent), bf16 in and out, the
// log-sum-exp of every (row, head) beside the output so that ranges of keys
// merge afterwards (attention_kernels.h, launch_prefill_merge). Query and key
// head dims 192 (nope 128 + rope 64), value 128: DeepSeek-V3's and
// Kimi-K2's, the one instantiation FlashInfer builds for unequal dims.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

namespace moelink::detail::attention {

// Where run() reads and writes (strides in elements, bf16 everywhere but lse).
struct FlashInferPrefillArgs {
  const uint16_t* q;  // [q_rows, heads, 192]
  int64_t q_stride_row, q_stride_head;
  const uint16_t* k;  // [keys, heads, 192]
  int64_t k_stride_row, k_stride_head;
  const uint16_t* v;  // [keys, heads, 128]
  int64_t v_stride_row, v_stride_head;
  uint16_t* out;  // [q_rows, heads, 128], softmax-normalized
  int64_t out_stride_row, out_stride_head;
  float* lse;  // [q_rows, heads] contiguous: log2 of each row's sum of exp(score) (scores scaled)
  int q_rows, keys, heads;
  float scale;  // softmax scale of the scores
  // Causal needs q_rows == keys: row i sees keys 0..i (the query rows are
  // the range's own tokens); else every row sees every key.
  bool causal;
};

class FlashInferPrefill {
 public:
  static constexpr int kQkDims = 192, kVDims = 128;
  // False in a build without FlashInfer's headers (MOELINK_FLASHINFER_DIR).
  static bool built();
  static std::unique_ptr<FlashInferPrefill> create();
  virtual ~FlashInferPrefill() = default;
  virtual void run(const FlashInferPrefillArgs& a, cudaStream_t stream) = 0;
};

}  // namespace moelink::detail::attention
