// moelink-plan: FLOPs, bytes and roofline time of each kernel of a decode step.
#pragma once
#include <string>
#include <vector>

#include "moelink/plan/hardware.h"
#include "moelink/plan/layout.h"
#include "moelink/plan/model.h"

namespace moelink::plan {

// Kernel classes of the seed's latency breakdown.
enum class KernelClass { kNorm, kGemm, kBmm, kAttention, kRouter, kGroupGemm, kActivation,
                         kAllReduce, kDispatch, kCombine };
const char* to_string(KernelClass c);
constexpr int kNumKernelClasses = 10;

// Pipeline stage of the seed's two-micro-batch schedule (1..5).
struct Kernel {
  std::string name;
  KernelClass cls = KernelClass::kGemm;
  int stage = 1;
  double flops = 0;
  double bytes = 0;       // HBM bytes read + written
  double peak_tflops = 0; // roof this kernel runs against (fp8 or bf16)
  double time_us = 0;     // roofline time incl. efficiency and kernel overhead
  bool memory_bound = true;
  double m = 0;           // GEMM rows (GroupGEMM: tokens per expert)
  bool measured = false;  // time_us from a --calibrate file (Calibration::apply)
  double intensity() const { return bytes > 0 ? flops / bytes : 0; }
};

// Roofline: max(flops / (peak*eff_c), bytes / (bw*eff_m)) + overhead.
void roofline(Kernel& k, double peak_tflops, double eff_compute, double hbm_gbps, double eff_mem,
              double overhead_us);

// Dense GEMM [m,k] x [k,n] with weight bytes wb and activation bytes ab.
Kernel gemm_kernel(const std::string& name, int stage, double m, double k, double n, double wb,
                   double ab, const GpuProfile& gpu);
// GroupGEMM: g groups of [m,k] x [k,n] (m = tokens per expert), g_active groups
// whose weights are read.
Kernel group_gemm_kernel(const std::string& name, int stage, double g, double g_active, double m,
                         double k, double n, double wb, const GpuProfile& gpu);

// Token counts of one layer on one GPU.
struct LayerShape {
  double tokens_dp = 0;        // tokens of the DP group (batch x query length)
  double tokens_moe = 0;       // tokens this GPU dispatches (tokens_dp / TP)
  double local_experts = 0;    // E / EP
  double tokens_per_expert = 0;  // m = tokens_moe * k * EP / E
  double active_experts = 0;     // local experts that receive >= 1 token
  double dest_ranks = 0;         // distinct ranks a token is sent to (expected)
  double dest_ranks_remote_node = 0;  // of which on other nodes
};
LayerShape layer_shape(const ModelSpec& m, const Layout& l, double batch, int query_len);

// Compute kernels of one layer (dense or MoE) on one GPU, without dispatch and combine.
std::vector<Kernel> layer_compute_kernels(const ModelSpec& m, const GpuProfile& gpu,
                                          const Layout& l, double batch, int query_len,
                                          int kv_len, bool moe);

// One dispatch or combine: time split into the send kernel, the transfer in
// flight (overlappable) and the receive kernel.
struct CommCost {
  double send_us = 0;
  double transfer_us = 0;
  double recv_us = 0;
  double bytes_nvlink = 0;
  double bytes_network = 0;
  bool measured = false;  // total from a --calibrate file (Calibration::apply)
  double total_us() const { return send_us + transfer_us + recv_us; }
};
// Bytes of one dispatched token row (fp8 + one fp32 scale per 128 values, or bf16).
double dispatch_row_bytes(const ModelSpec& m);
CommCost dispatch_cost(const ModelSpec& m, const GpuProfile& gpu, const NetworkProfile& net,
                       const Layout& l, const LayerShape& s);
CommCost combine_cost(const ModelSpec& m, const GpuProfile& gpu, const NetworkProfile& net,
                      const Layout& l, const LayerShape& s);

}  // namespace moelink::plan
