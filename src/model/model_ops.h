// The model's own steps between its parts (MLAAttention, MoELayer, the dense
// MLP's Experts): embedding, residual add with RMSNorm, lm_head, sampling;
// host loops (cpu_model_ops.cc) or CUDA kernels. Rows r < rows[0] only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/device_memory.h"
#include "moelink/types.h"

namespace moelink::detail::model {

// What the model's steps saw wrong in their input (a token id outside the
// vocabulary, sampling parameters out of range); the first one is kept.
struct ModelErrorRecord {
  int32_t code;  // 1: token_ids[row] = value outside [0, limit); 2: sampling field of request row
  int32_t field;  // code 2: 0 temperature, 1 top_k, 2 top_p
  int64_t row;
  double value;
  int64_t limit;
};

class ModelOps : public DeviceMemory {
 public:
  // dst = src (bytes), in stream order.
  virtual void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  // Waits for the work on `stream`.
  virtual void sync(cudaStream_t stream) = 0;

  // rows[0] = q_start[B] when it lies in [0, n], else 0: the rows every
  // step of the model touches (MLAAttention reports a bad q_start itself).
  virtual void step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows,
                         cudaStream_t stream) = 0;
  // h [*, D] bf16 = table [V, D] bf16 rows of token_ids [*] (a bad id gives
  // a zero row and an error).
  virtual void embed(const Tensor& h, const Tensor& token_ids, const uint16_t* table, int64_t vocab,
                     const int32_t* rows, ModelErrorRecord* error, cudaStream_t stream) = 0;
  // h += x (bf16, rounded once); normed = bf16(rmsnorm(h) * weight).
  // x undefined: the norm alone; weight null: the add alone.
  virtual void add_rms_norm(const Tensor& h, const Tensor& x, const Tensor& normed, const float* weight,
                            float eps, const int32_t* rows, cudaStream_t stream) = 0;
  // logits [k, V] fp32 = h[row_of(j)] . W^T (W [V, D] bf16, fp32
  // accumulation): every row r < rows (row_of = identity) when last_rows is
  // null, else each request's last row (q_start[j + 1] - 1; none for an
  // empty request: its logits row is left as it was).
  virtual void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
                       const int32_t* rows, const int32_t* q_start, int num_requests,
                       cudaStream_t stream) = 0;
  // next_tokens [B] int32 from logits [B, V] (sampling.h's rule; -1 for an
  // empty request); params may be undefined (greedy); positions: each
  // request's last position (kv_len - 1).
  virtual void sample(const Tensor& next_tokens, const Tensor& logits, const Tensor& temperature,
                      const Tensor& top_k, const Tensor& top_p, const Tensor& seed,
                      const int32_t* q_start, const int32_t* kv_len, int num_requests,
                      ModelErrorRecord* error, cudaStream_t stream) = 0;
  virtual ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t stream) = 0;
};

std::unique_ptr<ModelOps> make_cpu_model_ops();
// Throws InvalidArgument in a build without CUDA.
std::unique_ptr<ModelOps> make_cuda_model_ops();

}  // namespace moelink::detail::model
