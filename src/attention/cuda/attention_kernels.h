// The CUDA kernels behind CudaAttentionOps (cuda_attention_ops.cc), one per
// AttentionOps step (attention_ops.h gives each step's contract and shapes).
// Every kernel reads the step's counts (rows, decode rows, positions) on the
// device, with a grid sized by the buffers' bounds, so the decode steps can
// be captured in a CUDA graph. bf16 tensors are passed as uint16_t with row
// strides in elements.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention/attention_ops.h"

namespace moelink::detail::attention {

// The rotary settings every RoPE step takes.
struct RopeArgs {
  const float* inv_freq;  // [Dr / 2], device
  float attention_factor;
  bool interleaved;
};

void launch_plan_step(const MLABatch& b, int64_t n, const StepBounds& bounds, int local_heads,
                      const RowPlan& plan, StepErrorRecord* error, cudaStream_t stream);

void launch_rope_q(uint16_t* q, int64_t q_stride, int heads, int head_dim, int rope_dims,
                   const RowPlan& plan, int64_t max_rows, const RopeArgs& rope, cudaStream_t stream);

// cache [pages, page_size, R + Dr]; latent [rows, R], kpe [rows, Dr] (strided).
void launch_append_kv(uint16_t* cache, int page_size, const uint16_t* latent, int64_t latent_stride,
                      int R, const uint16_t* kpe, int64_t kpe_stride, int Dr,
                      const int32_t* block_table, int64_t block_stride, const RowPlan& plan,
                      int64_t max_rows, const RopeArgs& rope, cudaStream_t stream);

// dst [heads, Nd, width] (head and row strides dst_head_stride,
// dst_row_stride) from src rows; merge: the way back (src contiguous).
void launch_split_heads(uint16_t* dst, int64_t dst_head_stride, int64_t dst_row_stride, int64_t Nd,
                        int64_t width, const uint16_t* src, int64_t src_stride, int heads, int64_t head_stride,
                        int64_t offset, const int32_t* rows, cudaStream_t stream);
void launch_merge_heads(uint16_t* dst, int64_t dst_stride, const uint16_t* src, int64_t Nd,
                        int64_t width, int heads, const int32_t* rows, cudaStream_t stream);

// out_latent, q_latent [heads, Nd, R] contiguous; q [*, q_stride] rows with
// each head's rotary dims at h * head_dim + nope_dims.
void launch_decode_attention(uint16_t* out_latent, const uint16_t* q_latent, int64_t Nd, int R,
                             const uint16_t* q, int64_t q_stride, int head_dim, int nope_dims,
                             const uint16_t* cache, int page_size, int Dr,
                             const int32_t* block_table, int64_t block_stride, const RowPlan& plan,
                             int heads, float scale, cudaStream_t stream);

// Prefill: the running softmax of `rows` x `heads` query rows in fp32.
struct PrefillSoftmax {
  float* max;  // [rows, heads]
  float* sum;  // [rows, heads]
  float* acc;  // [rows, heads, v_dims]
  int64_t rows;
  int heads, v_dims;
};
void launch_prefill_begin(const PrefillSoftmax& s, cudaStream_t stream);
void launch_gather_kv(uint16_t* latent, int64_t latent_stride, int R, uint16_t* k_pe,
                      int64_t kpe_stride, int Dr, const uint16_t* cache, const int32_t* block_row,
                      int page_size, int64_t first, int64_t count, cudaStream_t stream);
void launch_prefill_chunk(const PrefillSoftmax& s, const uint16_t* q, int64_t q_stride,
                          int64_t q_row0, int64_t q_pos0, const uint16_t* kv, int64_t kv_stride,
                          const uint16_t* k_pe, int64_t kpe_stride, int64_t keys, int64_t k_pos0,
                          int nope_dims, int rope_dims, float scale, cudaStream_t stream);
void launch_prefill_finish(const PrefillSoftmax& s, uint16_t* out, int64_t out_stride,
                           int64_t row0, cudaStream_t stream);
// FlashInfer's prefill (flashinfer_prefill.h) around the same state: the
// keys [keys, heads, nope + rope] it reads, assembled from the chunk's
// kv_b expansion kv [keys, heads (nope + v)] and the shared k_pe [keys,
// rope]; one call's output o [rows, heads, v] (normalized) and lse [rows,
// heads] (log2) folded into the state's rows row0 .. row0 + rows - 1.
void launch_assemble_keys(uint16_t* k, const uint16_t* kv, int64_t kv_stride, const uint16_t* k_pe,
                          int64_t kpe_stride, int64_t keys, int heads, int nope_dims, int rope_dims,
                          int v_dims, cudaStream_t stream);
void launch_prefill_merge(const PrefillSoftmax& s, int64_t row0, const uint16_t* o, const float* lse,
                          int64_t rows, cudaStream_t stream);

void launch_set_count(int32_t* dst, int32_t value, cudaStream_t stream);

}  // namespace moelink::detail::attention
