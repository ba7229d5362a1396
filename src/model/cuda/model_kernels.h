// The CUDA kernels behind CudaModelOps (cuda_model_ops.cc); model_ops.h
// gives each step's contract. Counts are read on the device; bf16 tensors
// are passed as uint16_t with row strides in elements.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "model/model_ops.h"

namespace moelink::detail::model {

void launch_step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows,
                      cudaStream_t stream);
void launch_rebase_offsets(int32_t* dst, const int32_t* src, int first, int count, cudaStream_t stream);
// ModelOps::move_rows: a block per row of part (max_rows of them).
void launch_move_rows(uint16_t* part, int64_t part_stride, int64_t max_rows, uint16_t* whole, int64_t whole_stride,
                      int64_t D, const int32_t* first, const int32_t* count, bool into_part, cudaStream_t stream);
void launch_embed(uint16_t* h, int64_t h_stride, int64_t D, const int32_t* ids, int64_t ids_stride,
                  const uint16_t* table, int64_t vocab, const int32_t* rows, int64_t max_rows,
                  ModelErrorRecord* error, cudaStream_t stream);
// dst [k, D] = h rows row_index[j] (null: first + j) that lie below rows;
// zero rows where there is none, and valid[j] says which.
void launch_gather_rows(uint16_t* dst, const uint16_t* h, int64_t h_stride, int64_t D,
                        const int32_t* rows, const int32_t* row_index, int64_t first, int64_t k,
                        int32_t* valid, cudaStream_t stream);
// dst rows j with valid[j] = src rows (fp32, V wide).
void launch_copy_valid_rows(float* dst, int64_t dst_stride, const float* src, int64_t V,
                            const int32_t* valid, int64_t k, cudaStream_t stream);
// model_ops.h's plan_samples (draft_rules.h), a thread per request.
void launch_plan_samples(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts,
                         int num_requests, int slots, const int32_t* rows, int32_t* row_index,
                         int32_t* position, ModelErrorRecord* error, cudaStream_t stream);
// sampling.h's rule, one block per slot.
struct SampleArgs {
  int32_t* tokens;
  int64_t tokens_stride;
  const float* logits;
  int64_t logits_stride, vocab;
  const float* temperature;  // null: greedy
  const int32_t* top_k;      // null: 0
  const float* top_p;        // null: 1
  const int64_t* seed;       // null: 0
  const int32_t* row_index;  // [k]: -1 gives token -1
  const int32_t* position;   // [k]
  int64_t slots;             // k
  int slots_per_request;
  ModelErrorRecord* error;
};
void launch_sample(const SampleArgs& a, cudaStream_t stream);
// model_ops.h's accept_drafts (draft_rules.h), a block per request.
struct AcceptArgs {
  const int32_t* samples;
  const int32_t* row_index;
  int slots;
  const int32_t* ids;
  int64_t ids_stride;
  const int32_t* q_start;
  const int32_t* known_next;  // may be null
  int num_requests;
  int32_t* next_tokens;
  int64_t next_stride;
  int32_t* accepted;    // may be null
  int32_t* mtp_tokens;  // may be null (then draft_row too)
  int32_t* draft_row;
};
void launch_accept_drafts(const AcceptArgs& a, cudaStream_t stream);

}  // namespace moelink::detail::model
