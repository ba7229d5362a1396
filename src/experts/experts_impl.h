// The interface the CPU and CUDA expert kernels implement. The public
// Experts (experts.cc) checks every argument, then forwards; forward() is
// composed there from these calls and the workspace.
#pragma once

#include <memory>

#include "experts/expert_error.h"
#include "moelink/experts.h"

namespace moelink::detail {

// The workspace of forward(), in the implementation's memory.
struct ExpertWorkspace {
  Tensor gate_up;        // [L, C, 2I] bf16
  Tensor act_q;          // [L, C, I] fp8
  Tensor act_scale;      // [L, C, I/128] fp32, packed rows
};

// A 2-D tensor viewed as the only group of a 3-D one (the dense calls run
// the grouped code with one group).
inline Tensor as_one_group(Tensor t) {
  for (int d = 2; d > 0; --d) {
    t.shape[d] = t.shape[d - 1];
    t.stride[d] = t.stride[d - 1];
  }
  t.shape[0] = 1;
  t.stride[0] = 0;
  t.ndim = 3;
  return t;
}

class ExpertsImpl {
 public:
  virtual ~ExpertsImpl() = default;

  // Arguments are already checked (experts.h states the rules). `count`
  // is [groups] int32; `op` names the public call for error reports;
  // expected_rows (1 or more: the public call resolves 0) picks the CUDA
  // GEMMs' tiles.
  virtual void grouped_gemm(const Tensor& y, const Tensor& count, const Tensor& x,
                            const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                            experts::ExpertOp op, int64_t expected_rows, cudaStream_t stream) = 0;
  virtual void silu_mul_quant(const Tensor& out_q, const Tensor& out_scale, const Tensor& gate_up,
                              const Tensor& count, experts::ExpertOp op, cudaStream_t stream) = 0;
  // forward()'s steps, after its checks: GEMM1 of x into gate_up,
  // SiLU-and-mul with the requantization into act_q / act_scale, GEMM2 into
  // y (gate_up, act_q, act_scale: the workspace viewed with x's C rows).
  // This runs the three calls above in turn; CUDA also writes both GEMMs'
  // device-side arguments up front.
  virtual void forward(const Tensor& y, const Tensor& count, const Tensor& x, const Tensor& x_scale,
                       const Tensor& w13, const Tensor& w13_scale, const Tensor& w2,
                       const Tensor& w2_scale, const Tensor& gate_up, const Tensor& act_q,
                       const Tensor& act_scale, int64_t expected_rows, cudaStream_t stream) {
    grouped_gemm(gate_up, count, x, x_scale, w13, w13_scale, experts::ExpertOp::kForward, expected_rows,
                 stream);
    silu_mul_quant(act_q, act_scale, gate_up, count, experts::ExpertOp::kForward, stream);
    grouped_gemm(y, count, act_q, act_scale, w2, w2_scale, experts::ExpertOp::kForward, expected_rows,
                 stream);
  }
  // bound_m may be undefined (all rows).
  virtual void quantize(const Tensor& out_q, const Tensor& out_scale, const Tensor& x,
                        const Tensor& bound_m, cudaStream_t stream) = 0;
  virtual void gemm(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
                    const Tensor& w_scale, const Tensor& bound_m, cudaStream_t stream) = 0;

  virtual const ExpertWorkspace& workspace() const = 0;
  virtual size_t workspace_bytes() const = 0;
  // Waits for the work on `stream`, returns the error record and clears it.
  // Returns an empty record inside a CUDA graph capture.
  virtual experts::ExpertErrorRecord take_error(cudaStream_t stream) = 0;
};

std::unique_ptr<ExpertsImpl> make_cpu_experts(const ExpertConfig& config);
// Throws InvalidArgument in a build without CUDA.
std::unique_ptr<ExpertsImpl> make_cuda_experts(const ExpertConfig& config);

}  // namespace moelink::detail
