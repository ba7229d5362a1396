// The dense fp8 block-scaled GEMM with its output tiles' K range dealt over
// the SMs (split-K or stream-K), reduced inside the one kernel:
//   y[r][n] = bf16( sum_kb  x_scale[r][kb] * w_scale[n/128][kb]
//                           * sum_{k in block kb} x[r][k] * w[n][k] ),  r < m
// x fp8 e4m3 [m, K] (K contiguous), x_scale fp32 [m, K/128] packed rows, w
// fp8 e4m3 [N, K], w_scale fp32 [N/128, K/128] packed rows, y bf16 [m, N];
// m on the host (every row is computed and written).
//
// Why: a decode-sized dense GEMM with few output tiles leaves most SMs idle
// on the tiled kernels (DeepSeek-V3's merged qkv_a, N 2176: 17 tiles of 128
// columns for 132 SMs at up to 128 tokens, each streaming all of K = 7168).
// The grouped split-K (split_k.cu) fills the SMs but pays a reduce kernel,
// fp32 partials through memory and the grouped kernel's per-tile cost, and
// measured no faster (docs/experts.md). This one is CUTLASS's ungrouped
// Hopper kernel (cooperative 128 x 128 x 128 tiles, TMA, blockwise scale
// promotion) under CUTLASS's stream-K tile scheduler: the CTAs that share a
// tile add their fp32 accumulators through a small workspace in L2, in a
// fixed order (deterministic), and the last one runs the epilogue.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moelink::detail::experts {

struct DenseGemmArgs {
  const void* x;  // fp8 [m, k], rows x_row_stride elements apart
  int64_t x_row_stride;
  const float* x_scale;  // [m, k/128] packed
  const void* w;         // fp8 [n, k], rows w_row_stride apart
  int64_t w_row_stride;
  const float* w_scale;  // [n/128, k/128] packed
  void* y;               // bf16 [m, n], rows y_row_stride apart
  int64_t y_row_stride;
  int64_t m;     // >= 1
  int32_t n, k;  // multiples of 128
};

// How the output tiles' K ranges are dealt to the CTAs. splits > 1: every
// tile cut into that many K slices (split-K; CUTLASS evens the slices'
// lengths); 0: CUTLASS's stream-K decomposition (whole tiles where they fill
// whole waves, the remainder's K iterations spread evenly over the SMs).
struct DenseSchedule {
  int splits = 0;
};

// The split count (2 to 4) for an m x n x k GEMM on `sm_count` SMs, or 1
// where the tiled kernels are as fast: above 64 rows (where they run
// 128-row tiles), while its tiles fill at most half of the SMs; as many
// slices as keep one wave of CTAs, at most 4, each at least 4 k-blocks.
int dense_split_for(int64_t m, int64_t n, int64_t k, int sm_count);

class DenseStreamKGemm {
 public:
  virtual ~DenseStreamKGemm() = default;
  // Workspace bytes a call with these dimensions and schedule needs (fp32
  // partial tiles, then a lock per tile and consumer warpgroup). Calls of
  // the same ceil(m/128), n, k and schedule lay it out alike.
  virtual size_t workspace_bytes(const DenseGemmArgs& a, DenseSchedule s) const = 0;
  // Launches the GEMM on `stream` (with PDL when `programmatic`: the kernel
  // waits for the previous one before it reads). `workspace`: at least
  // workspace_bytes(a, s), zero before its first use and used only by calls
  // laid out alike (each launch leaves its locks zero again, and the
  // partial tiles of another layout would be read as locks). Calls sharing
  // a workspace are ordered on one stream.
  virtual void run(const DenseGemmArgs& a, DenseSchedule s, void* workspace, cudaStream_t stream,
                   bool programmatic) = 0;
};

// For the current CUDA device. Throws InvalidArgument when it is not a
// Hopper GPU (sm_90).
std::unique_ptr<DenseStreamKGemm> make_dense_stream_k_gemm();

}  // namespace moelink::detail::experts
