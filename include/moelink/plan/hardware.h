// moelink-plan: GPU and network profiles (data files under profiles/).
#pragma once
#include <string>

namespace moelink::plan {

// Fraction of the datasheet peak a kernel class reaches, and a fixed cost per
// kernel; see docs/planner.md for where the defaults come from.
struct Efficiency {
  double gemm_compute = 0.7;    // GEMM / GroupGEMM / BMM vs FLOP peak
  double gemm_memory = 0.75;    // GEMM / GroupGEMM / BMM vs HBM bandwidth
  double attention_memory = 0.7;
  double elementwise_memory = 0.6;
  double kernel_overhead_us = 3.0;  // per kernel (launch under CUDA graph + ramp)
  double step_overhead_us = 200.0;  // per decode step: sampling, scheduling, embedding
};

struct GpuProfile {
  std::string name;
  double fp8_tflops = 0;   // dense peak
  double bf16_tflops = 0;
  double hbm_bytes = 0;    // nominal capacity
  double hbm_gbps = 0;     // GB/s
  double nvlink_gbps = 0;  // per GPU, one direction, GB/s
  int gpus_per_node = 8;
  double usable_fraction = 0.95;       // of hbm_bytes the serving engine may use
  double runtime_reserve_bytes = 3e9;  // CUDA context, workspaces, activations
  Efficiency eff;
};

struct NetworkProfile {
  std::string name;
  bool inter_node = false;     // false: NVLink only, a layout must fit in one node
  double gbps_per_gpu = 0;     // inter-node, one direction, GB/s
  double efficiency = 1.0;     // fraction of gbps_per_gpu an all-to-all reaches
  double latency_us = 0;       // fixed cost of one dispatch or combine across nodes (in flight)
  double kernel_us = 0;        // GPU time of each send and each receive kernel beyond the launch
                               // (packing, posting work requests, polling): never hidden
  double nvlink_efficiency = 0.85;
  double nvlink_latency_us = 12;  // fixed cost of one dispatch or combine inside a node
  // true: inside one node (EP <= GPUs per node) the send/receive kernels move the
  // data themselves (NVLink loads/stores), so the transfer is GPU time that no
  // overlap mode can hide (see docs/planner.md, "nvlink-seed").
  bool nvlink_transfer_in_kernel = false;
};

GpuProfile gpu_from_json_text(const std::string& text, const std::string& fallback_name);
NetworkProfile network_from_json_text(const std::string& text, const std::string& fallback_name);

}  // namespace moelink::plan
