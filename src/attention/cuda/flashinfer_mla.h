// FlashInfer's MLA attention for Hopper (flashinfer::mla::BatchMLAPageAttentionHopper,
// FlashInfer 0.7.4's C++ headers, used header-only like CUTLASS) behind a
// plan/run split: plan() schedules a batch from host copies of its query
// ranges and lengths (FlashInfer's MLAPlan, a load-balanced split over the
// SMs) and stages the schedule into device memory on the stream; run()
// launches the kernel, which reads the pages through the block table on the
// device. bf16 query, cache and output; latent 512 and rotary 64 dims (the
// instantiation DeepSeek-V3 and Kimi-K2 need); causal within each request's
// query tokens (MTP's two tokens).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

namespace moelink::detail::attention {

// Where run() reads and writes (strides in elements).
struct FlashInferMLAArgs {
  const uint16_t* q_latent;  // [rows, heads, 512] via the strides
  int64_t q_latent_stride_row, q_latent_stride_head;
  const uint16_t* q_pe;  // [rows, heads, 64] via the strides
  int64_t q_pe_stride_row, q_pe_stride_head;
  const uint16_t* cache;  // [pages, page_size, 576]: latent then rotary dims
  int page_size;
  const int32_t* block_table;  // kv_indices: request i's pages from kv_indptr[i]
  uint16_t* out;  // [rows, heads, 512] via the strides
  int64_t out_stride_row, out_stride_head;
  float scale;
};

class FlashInferMLA {
 public:
  static constexpr int kLatent = 512, kRope = 64;
  // False in a build without FlashInfer's headers (MOELINK_FLASHINFER_DIR).
  static bool built();
  // Workspaces for `heads` heads on the current device.
  static std::unique_ptr<FlashInferMLA> create(int heads);
  virtual ~FlashInferMLA() = default;
  // Request i: query rows q_indptr[i] .. q_indptr[i+1] - 1, the last of its
  // kv_len[i] tokens, its pages block_table[kv_indptr[i] ...] (host arrays).
  // Inside a CUDA graph capture the plan's copy to the device is captured:
  // it reads the host staging buffer when the graph runs, which replan()
  // rewrites before each replay. One object may serve the layers of a
  // model (MLAAttention's share_with), which plan the same batch one after
  // another: a plan of the inputs the last one had, on the same stream and
  // in the same capture (or none), is that one (nothing is planned again).
  virtual void plan(const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_len,
                    int batch, cudaStream_t stream) = 0;
  // For the plan captured at this batch size (the last capture of that
  // size; one graph per batch size): a new batch's schedule into the
  // staging buffer the captured copy reads (the previous replay must have
  // finished); the same batch again (the replay's next layer) is that one.
  // Throws InvalidArgument when its grid or layout differs from the
  // captured one (capture again), or when nothing of that size was
  // captured.
  virtual void replan(const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_len,
                      int batch) = 0;
  // Whether the last capture at this batch size planned here (its replays
  // need replan()); forget_capture() for a capture of that size on `stream`
  // that runs another kernel instead (a plan an earlier layer of that same
  // capture made stays).
  virtual bool captured(int batch) const = 0;
  virtual void forget_capture(int batch, cudaStream_t stream) = 0;
  virtual void run(const FlashInferMLAArgs& a, cudaStream_t stream) = 0;
};

}  // namespace moelink::detail::attention
