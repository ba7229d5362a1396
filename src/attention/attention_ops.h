// The steps of MLAAttention that are neither GEMMs nor quantization (those
// are Experts'), on the object's device: host loops (cpu_attention_ops.cc)
// or CUDA kernels. Every step reads the batch's values where it runs and
// touches only the rows plan_step() let through.
//
// Shapes (attention.h's notation; n the rows of x, Nd = 2 * max_requests the
// decode rows the buffers hold):
//   q       [n, Hq (Dn + Dr)] bf16: q_b_proj's output, rotary dims roped in place
//   latent  [n, R] bf16: kv_a_layernorm of the new tokens' latent
//   kpe     [n, Dr] bf16 view (row stride of qkv_a): their rotary key dims before RoPE
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "attention/rope.h"
#include "attention/step_plan.h"
#include "core/device_memory.h"
#include "moelink/attention.h"

namespace moelink::detail::attention {

// Where each row of x goes, written by plan_step(): the request it belongs
// to (-1: skipped, or past q_start[B]) and its position.
struct RowPlan {
  int32_t* request;  // [n]
  int32_t* position; // [n]
  int32_t* rows;     // [1]: rows the step computes (the GEMMs' bound)
  int32_t* decode_rows;  // [Hq]: q_start[num_decode] per head (the batched GEMMs' counts)
};

class AttentionOps : public DeviceMemory {
 public:
  // Waits for the work on `stream` (before the host reads what it wrote).
  virtual void sync(cudaStream_t stream) = 0;
  // *dst = value, in stream order (a count the next steps read).
  virtual void set_count(int32_t* dst, int32_t value, cudaStream_t stream) = 0;

  // Checks the batch (step_plan.h) and fills `plan`.
  virtual void plan_step(const MLABatch& b, int64_t n, const StepBounds& bounds, int local_heads,
                         const RowPlan& plan, StepErrorRecord* error, cudaStream_t stream) = 0;

  // y[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * weight) for r < rows[0]
  // (x, y bf16 [*, cols] with row strides; weight fp32 [cols]).
  virtual void rms_norm(const Tensor& y, const Tensor& x, const float* weight, float eps,
                        const int32_t* rows, cudaStream_t stream) = 0;

  // RoPE on each head's last Dr dims of q, at each row's position.
  virtual void rope_q(const Tensor& q, int heads, int head_dim, int rope_dims, const RowPlan& plan,
                      const float* inv_freq, float attention_factor, bool interleaved,
                      cudaStream_t stream) = 0;

  // AppendKV: cache row of (request, position) = [latent, rope(kpe)] for
  // every planned row.
  virtual void append_kv(const Tensor& cache, const Tensor& latent, const Tensor& kpe,
                         const MLABatch& b, const RowPlan& plan, const float* inv_freq,
                         float attention_factor, bool interleaved, cudaStream_t stream) = 0;

  // dst [heads, Nd, width] (any head and row strides, the width
  // contiguous) = src[r][h * head_stride + offset .. + width) for rows r <
  // rows (a count in the object's memory; the decode rows), and back: dst
  // [*, heads * width] rows r < rows = src [heads, Nd, width] (contiguous).
  virtual void split_heads(const Tensor& dst, const Tensor& src, int heads, int64_t head_stride,
                           int64_t offset, const int32_t* rows, cudaStream_t stream) = 0;
  virtual void merge_heads(const Tensor& dst, const Tensor& src, int heads, const int32_t* rows,
                           cudaStream_t stream) = 0;

  // The absorbed decode's per-head GEMMs in bf16 (MLAHeadGemm::kBf16):
  //   y [heads, Nd, N] bf16 = x [heads, Nd, K] bf16 . w[h]^T,  w [heads, N, K] bf16,
  // y and x by their head and row strides (the last dim contiguous),
  // fp32 accumulation, for each head's rows < rows_bound (the host's bound
  // on the decode rows: 2 x num_decode). Rows past the device count rows[0]
  // hold whatever their inputs held and are never read after; the CPU path
  // computes only rows < rows[0].
  virtual void head_gemm(const Tensor& y, const Tensor& x, const uint16_t* w, int64_t rows_bound,
                         const int32_t* rows, cudaStream_t stream) = 0;

  // Absorbed decode attention of the first num_decode requests' rows:
  //   out_latent [Hq, Nd, R] bf16 = softmax(scale (q_latent . c + q_pe . k_pe)) . c
  // over each row's request tokens up to its position; q_latent [Hq, Nd, R]
  // bf16 (row stride R, or R + Dr after decode_query_with_rope() said yes:
  // then the roped dims follow each row's latent there), q_pe the roped
  // dims of q. Skipped rows get zeros.
  virtual void decode_attention(const Tensor& out_latent, const Tensor& q_latent, const Tensor& q,
                                const Tensor& cache, const MLABatch& b, const RowPlan& plan,
                                int heads, int nope_dims, float scale, cudaStream_t stream) = 0;
  // Whether decode_attention() of batch `b` on `stream` takes its query as
  // one vector of R + Dr a row and head (FlashMLA's layout): q_latent's
  // rows R + Dr apart, each followed by its roped dims, which the caller
  // writes there (split_heads). Only with MLAHeadGemm::kBf16 (the fp8 head
  // GEMM writes contiguous rows). The same batch, stream and capture state
  // give the same answer.
  virtual bool decode_query_with_rope(const MLABatch& b, cudaStream_t stream) {
    (void)b;
    (void)stream;
    return false;
  }

  // Prefill, one request at a time (eager), over its keys in chunks:
  // gather_kv() copies cache tokens [first, first + count) of the request
  // into latent [count, R] and k_pe [count, Dr]; prefill_chunk() folds
  // their scores into the running softmax state of the request's query rows
  // (kv [count, Hq (Dn + Dv)] bf16: kv_b_proj of the latent); prefill_finish()
  // writes out [rows, Hq Dv] bf16 from the state.
  struct PrefillState {  // the running softmax of one request's query rows
    virtual ~PrefillState() = default;
  };
  virtual std::unique_ptr<PrefillState> prefill_begin(int64_t query_rows, int heads, int v_dims,
                                                      cudaStream_t stream) = 0;
  virtual void gather_kv(const Tensor& latent, const Tensor& k_pe, const Tensor& cache,
                         const int32_t* block_row, int page_size, int64_t first, int64_t count,
                         cudaStream_t stream) = 0;
  virtual void prefill_chunk(PrefillState& s, const Tensor& q, int64_t q_row0, int64_t q_rows,
                             int64_t q_pos0, const Tensor& kv, const Tensor& k_pe, int64_t k_pos0,
                             int heads, int nope_dims, int rope_dims, int v_dims, float scale,
                             cudaStream_t stream) = 0;
  virtual void prefill_finish(PrefillState& s, const Tensor& out, int64_t row0, cudaStream_t stream) = 0;

  // dst rows [row0, row0 + rows) = 0 (a skipped prefill request).
  virtual void zero_rows(const Tensor& dst, int64_t row0, int64_t rows, cudaStream_t stream) = 0;

  // Waits for the work on `stream`; returns the record and clears it.
  virtual StepErrorRecord take_error(StepErrorRecord* record, cudaStream_t stream) = 0;
  // Before replaying a CUDA graph that captured a decode step: whatever the
  // device kernels cannot read on the device (FlashInfer's plan) for batch
  // `b` (its host copies). Nothing to do on the host or for moelink's kernel.
  virtual void prepare_replay(const MLABatch& b, const Tensor& cache) {
    (void)b;
    (void)cache;
  }
};

std::unique_ptr<AttentionOps> make_cpu_attention_ops();
// Throws InvalidArgument in a build without CUDA, or for a decode or
// prefill kernel that cannot run this attention (naming the MLAOptions
// field).
// (MLAOptions: decode_kernel, prefill_kernel, and the page size and head
// GEMM FlashMLA's decode needs.)
std::unique_ptr<AttentionOps> make_cuda_attention_ops(const MLAConfig& config, int local_heads,
                                                      const MLAOptions& options);

}  // namespace moelink::detail::attention
