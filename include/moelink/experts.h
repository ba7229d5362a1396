// Experts: the expert computation between dispatch and combine, on the
// batched-experts layout dispatch produces, in DeepSeek-V3's fp8 format.
//
//   y = down( silu(gate(x)) * up(x) )   for each local expert's rows
//
// with fp8 e4m3 weights scaled per 128 x 128 block (a checkpoint's `weight`
// and `weight_scale_inv`) and fp8 activations scaled per 1 x 128 group along
// K, quantized on the fly. Kernels (CUDA on Hopper; plain loops on the CPU):
//   grouped_gemm    fp8 x fp8 -> bf16, fp32 accumulation, block scales, over
//                   the experts' device-side row counts (empty experts skipped)
//   silu_mul_quant  SiLU(gate) * up fused with the 1x128 requantization
//   quantize        1x128 per-token-group quantization of bf16 activations
//   gemm            the dense block-scaled GEMM (the shared expert): one group
//   forward         grouped_gemm -> silu_mul_quant -> grouped_gemm
//
// Notation: L local experts, C rows per expert (AllToAll's expert_capacity),
// H hidden_dim, I intermediate_dim (DeepSeek-V3's moe_intermediate_size),
// K the reduced dimension and N the output dimension of a GEMM, both
// multiples of 128. Row counts live in device memory (host memory for
// ExpertDevice::kCPU) and are never read by the host: every call is
// capturable in a CUDA graph and replays with new counts. Rows >= a count
// are never written. A count outside [0, C] is clamped (nothing is written
// out of bounds) and reported by check().
//
// Tensors are moelink::Tensor views (types.h): device memory for kCUDA, host
// memory for kCPU. fp8 tensors may be passed as uint8.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moelink/types.h"

namespace moelink {

enum class ExpertDevice {
  kCUDA,  // the current CUDA device; needs a Hopper GPU (sm_90)
  kCPU,   // plain loops on host tensors (tests, CI, the cpu backend)
};
const char* expert_device_name(ExpertDevice d);  // "cuda", "cpu"

struct ExpertConfig {
  int num_experts = 0;       // L: local experts (AllToAll's num_local_experts), 1..65535
  int64_t max_rows = 0;      // C: rows per expert (AllToAll's expert_capacity), 1..2^24
  int hidden_dim = 0;        // H: multiple of 128
  int intermediate_dim = 0;  // I: per expert, multiple of 128
  ExpertDevice device = ExpertDevice::kCUDA;
  // Rows an expert is expected to hold; picks the GEMM tiles on the GPU
  // (<= 32: weight-major tiles with 32 token rows, <= 64: 64-row tiles,
  // else 128-row tiles; docs/experts.md). 0: max_rows.
  int64_t expected_rows = 0;
  // Run check() after every call (synchronizing the stream). < 0: read
  // MOELINK_DEBUG.
  int debug = -1;

  // Throws InvalidArgument naming the field, its value and the rule.
  void validate() const;
  std::string to_string() const;
};

namespace detail {
class ExpertsImpl;
}

class Experts {
 public:
  // Allocates the workspace of forward(): [L, C, 2I] bf16 for the first
  // GEMM's output and [L, C, I] fp8 + [L, C, I/128] fp32 for its quantized
  // SiLU-and-mul (workspace_bytes()).
  static std::unique_ptr<Experts> create(const ExpertConfig& config);
  ~Experts();
  Experts(const Experts&) = delete;
  Experts& operator=(const Experts&) = delete;

  const ExpertConfig& config() const;
  size_t workspace_bytes() const;

  // The expert MLP on dispatch's output, into the tensor combine takes:
  //   expert_num_tokens [L]            int32: rows per expert (dispatch's count)
  //   expert_x          [L, C, H]      fp8, rows contiguous and 16-byte aligned
  //   expert_x_scale    [L, C, H/128]  fp32, packed rows (stride [*, H/128, 1])
  //   w13               [L, 2I, H]     fp8: gate_proj rows 0..I-1, up_proj rows I..2I-1
  //   w13_scale         [L, 2I/128, H/128]  fp32 (weight_scale_inv), packed rows
  //   w2                [L, H, I]      fp8: down_proj
  //   w2_scale          [L, H/128, I/128]   fp32, packed rows
  //   expert_y          [L, C, H]      bf16 out, rows contiguous: for r < count,
  //                     y = w2 . q(silu(w13[:I] . x) * (w13[I:] . x))
  // L, C, H and I are the config's. expected_rows: the rows an expert is
  // expected to hold in this call (e.g. the batch's tokens x top-k / experts),
  // which picks the GPU GEMMs' tiles as the config's does; 0: the config's,
  // larger values count as the config's (the GEMMs exist for row counts up
  // to it: a call inside a CUDA graph capture allocates nothing).
  void forward(const Tensor& expert_y, const Tensor& expert_num_tokens, const Tensor& expert_x,
               const Tensor& expert_x_scale, const Tensor& w13, const Tensor& w13_scale,
               const Tensor& w2, const Tensor& w2_scale, cudaStream_t stream = nullptr,
               int64_t expected_rows = 0);

  // y[l][r] = x[l][r] . w[l]^T with block scales, for r < count[l]:
  //   y        [L, C, N]        bf16, rows contiguous and 16-byte aligned
  //   count    [L]              int32
  //   x        [L, C, K]        fp8, rows contiguous and 16-byte aligned
  //   x_scale  [L, C, K/128]    fp32, packed rows
  //   w        [L, N, K]        fp8, rows contiguous and 16-byte aligned
  //   w_scale  [L, N/128, K/128]  fp32, packed rows
  // L is the config's; C, N and K any (N, K multiples of 128);
  // expected_rows as forward()'s.
  void grouped_gemm(const Tensor& y, const Tensor& count, const Tensor& x, const Tensor& x_scale,
                    const Tensor& w, const Tensor& w_scale, cudaStream_t stream = nullptr,
                    int64_t expected_rows = 0);

  // For r < count[l], j < I/128:
  //   v = silu(gate_up[l][r][j*128 + i]) * gate_up[l][r][I + j*128 + i], i < 128
  //   out_scale[l][r][j] = max(max|v|, 1e-10) / 448,  out_q[l][r][j*128 + i] = v / scale
  //   gate_up   [L, C, 2I]      bf16, rows contiguous and 16-byte aligned
  //   out_q     [L, C, I]       fp8, rows contiguous and 8-byte aligned
  //   out_scale [L, C, I/128]   fp32, any strides
  void silu_mul_quant(const Tensor& out_q, const Tensor& out_scale, const Tensor& gate_up,
                      const Tensor& count, cudaStream_t stream = nullptr);

  // 1x128 per-token-group quantization, for rows r < m (m = bound_m[0] when
  // given, else M):
  //   x         [M, K]       bf16, rows contiguous and 16-byte aligned
  //   out_q     [M, K]       fp8, rows contiguous and 8-byte aligned
  //   out_scale [M, K/128]   fp32, any strides (packed rows for gemm())
  //   bound_m   [1] int32 or undefined
  void quantize(const Tensor& out_q, const Tensor& out_scale, const Tensor& x,
                const Tensor& bound_m = {}, cudaStream_t stream = nullptr);

  // The dense block-scaled GEMM (one group): y = x . w^T for rows r < m
  // (m = bound_m[0] when given, else M):
  //   y [M, N] bf16; x [M, K] fp8; x_scale [M, K/128] fp32 packed rows;
  //   w [N, K] fp8; w_scale [N/128, K/128] fp32 packed rows.
  void gemm(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
            const Tensor& w_scale, const Tensor& bound_m = {}, cudaStream_t stream = nullptr);

  // Waits for the work issued on `stream` and throws InputError for a count
  // the kernels had to clamp (naming the call, the expert and the value),
  // once. Inside a CUDA graph capture it reports nothing.
  void check(cudaStream_t stream = nullptr);

 private:
  explicit Experts(std::unique_ptr<detail::ExpertsImpl> impl);
  int64_t call_expected_rows(const char* call, int64_t expected_rows) const;
  std::unique_ptr<detail::ExpertsImpl> impl_;
  ExpertConfig config_;  // with expected_rows and debug resolved
};

}  // namespace moelink
