// moelink's MLA decode kernel on tensor cores (mma.sync m16n8k16: bf16 in,
// fp32 accumulation), the "moelink" decode of CudaAttentionOps where its
// shapes apply (latent R of 128, 256 or 512, rotary dims 64).
//
// MLA's absorbed decode is multi-query attention: every head of a request
// reads the same cache rows [latent R | rotary 64], as keys over all R + 64
// dims and as values over the R latent dims. A block takes one decode row
// and 32 heads (16 at 16 heads or fewer), two groups of 4 warps with 16
// heads each (the MMAs' M), against the row's keys, 64 keys a stage,
// streamed into shared memory with cp.async two stages deep while the
// previous stage computes: scores Q K^T over R + 64 dims (each of a group's
// 4 warps 16 keys), the online softmax across the warps, then P V (each
// warp R / 4 output dims). On Hopper at latent 512 the warpgroup-MMA kernel
// (mla_decode_wgmma.cu) runs instead where it applies (below). Rows whose
// keys are too few to fill the GPU split
// their keys over several blocks (grid.z) whose normalized outputs and
// log-sum-exps a second kernel merges. Every count (rows, keys, requests)
// is read on the device: the grid depends only on the buffers' bounds, so
// a CUDA graph replays it for any batch of those bounds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attention/attention_ops.h"

namespace moelink::detail::attention {

struct TcDecodeArgs {
  uint16_t* out_latent;       // [heads, Nd, R] bf16: each row's attention output in the latent space
  const uint16_t* q_latent;   // [heads, Nd, R] bf16: the absorbed queries' latent part
  const uint16_t* q;          // query rows [*, q_stride]: head h's rotary dims at h * head_dim + nope_dims
  int64_t q_stride;
  int head_dim, nope_dims;
  const uint16_t* cache;      // [num_pages, page_size, R + 64] bf16
  int64_t num_pages;
  int page_size;
  const int32_t* block_table;  // [requests, *] int32, row stride block_stride
  int64_t block_stride;
  int64_t max_keys;           // an upper bound of any row's keys (the block table's pages x page_size)
  RowPlan plan;               // per row: request (-1: none; its output zeros) and position (keys = position + 1)
  int64_t Nd;                 // decode rows the buffers hold (rows >= plan.decode_rows[0] are skipped)
  int64_t rows_bound;         // what the host knows of the decode rows (<= Nd): the grid's rows and the
                              // key splits are sized by it (a CUDA graph replays it for batches up to it)
  int R, heads;
  float scale;                // softmax scale
};

// Whether the kernel takes these shapes (else the scalar decode kernel runs).
bool tc_decode_supported(int R, int rope_dims);

// Bytes of workspace launch_tc_decode needs for these shapes (0: none, the
// keys are not split).
size_t tc_decode_workspace_bytes(const TcDecodeArgs& a);

// workspace: tc_decode_workspace_bytes(a) bytes of device memory. Runs the
// warpgroup-MMA kernel below where it applies (MOELINK_MLA_DECODE_WGMMA=0
// keeps this file's), else the mma.sync one.
void launch_tc_decode(const TcDecodeArgs& a, void* workspace, cudaStream_t stream);

// The warpgroup-MMA kernel (mla_decode_wgmma.cu, in builds for sm_90a):
// whether it takes these arguments on this GPU (Hopper; latent 512, rotary
// 64; 16-byte aligned queries and cache), and its launch over `splits` key
// splits (64 heads a block, or a request's rows at 32 heads or fewer; one
// block a multiprocessor), whose partials launch_tc_decode merges.
bool wgmma_decode_applies(const TcDecodeArgs& a);
void launch_wgmma_decode(const TcDecodeArgs& a, void* workspace, int splits, cudaStream_t stream);
// Its out-of-step variant (mla_decode_seesaw.cu; launch_wgmma_decode picks
// it under MOELINK_MLA_DECODE_SEESAW=1 where seesaw_decode_applies: more
// than 32 heads, a page size whose TMA boxes fit, gcd(page_size, 64) >= 8),
// on the grid launch_wgmma_decode lays out (inner_head_blocks: the kernel's
// argument, > 0 where a row's head blocks sit side by side in grid.x).
bool seesaw_decode_applies(const TcDecodeArgs& a);
void launch_seesaw_decode(const TcDecodeArgs& a, void* workspace, dim3 grid, int inner_head_blocks,
                          cudaStream_t stream);

}  // namespace moelink::detail::attention
