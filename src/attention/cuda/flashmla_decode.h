// FlashMLA's dense MLA decode for Hopper (deepseek-ai/FlashMLA at 9241ae3,
// its sm90 bf16 kernel, the scheduler that splits the keys over the SMs and
// the kernel that merges the splits; compiled from its source tree, given as
// MOELINK_FLASHMLA_DIR) over moelink's step: every query row is a request of
// one query token to FlashMLA, whose keys are its row's (position + 1 of its
// request's cache: MTP's second token sees one key more than its first), so
// q_len 1 and 2 mix in one batch. Nothing is read on the host: the rows'
// lengths and block-table rows are written on the device from the step's
// row plan, the schedule on the device from them, so a CUDA graph captures
// the whole decode and replays it with new lengths and tables.
//
// The query is the latent and the rotary dims of a row and head as one 576-
// vector (FlashMLA's layout): MLAAttention writes q_nope through W_UK and
// the roped dims side by side for this kernel (AttentionOps::
// decode_query_with_rope).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

namespace moelink::detail::attention {

struct FlashMLADecodeArgs {
  // [heads, rows, 576] bf16 via the strides (elements): each row and head's
  // latent (512) then rotary dims (64), contiguous.
  const uint16_t* q;
  int64_t q_stride_head, q_stride_row;
  const uint16_t* cache;  // [num_pages, 64, 576] bf16: latent then rotary dims
  int64_t num_pages;
  const int32_t* block_table;  // [requests, max_pages] with row stride block_stride
  int64_t block_stride;
  int32_t max_pages;
  // The step's row plan (attention_ops.h RowPlan): a row's request (-1:
  // skipped, its output zeros) and position; rows r >= decode_rows[0] are
  // not decode rows (their output is whatever: never read).
  const int32_t* request;
  const int32_t* position;
  const int32_t* decode_rows;
  uint16_t* out;  // [heads, rows, 512] bf16 via the strides
  int64_t out_stride_head, out_stride_row;
  int rows;  // rows the kernels cover (the host's bound; fixed in a graph)
  float scale;
};

class FlashMLADecode {
 public:
  static constexpr int kLatent = 512, kRope = 64, kPageSize = 64;
  // False in a build without FlashMLA's source (MOELINK_FLASHMLA_DIR).
  static bool built();
  // The SMs of the current device split among this many parts of the keys
  // (FlashMLA's rule); FlashMLA's merge kernel takes at most 160.
  static int sm_parts(int heads);
  // For `heads` query heads a row (this rank's); the key split counted once.
  static std::unique_ptr<FlashMLADecode> create(int heads);
  virtual ~FlashMLADecode() = default;
  // Workspace grows with the rows (device memory kept; a capture may grow
  // it: RelaxedCaptureMode). The caller checks the shapes: 576-dim cache
  // rows of pages of 64, 1 <= rows, sm_parts(heads) <= 160.
  virtual void run(const FlashMLADecodeArgs& a, cudaStream_t stream) = 0;
};

}  // namespace moelink::detail::attention
