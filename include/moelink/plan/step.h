// moelink-plan: time of one decode step and the serving metrics that follow.
#pragma once
#include <array>
#include <optional>
#include <vector>

#include "moelink/plan/cost.h"

namespace moelink::plan {

class Calibration;

struct PlanInput {
  ModelSpec model;
  GpuProfile gpu;
  NetworkProfile net;
  Layout layout;
  Workload work;
  // --calibrate files: measured times replace modelled ones where a file
  // describes the layout; where two measure the same, the later one wins.
  std::vector<const Calibration*> calibrations{};
};

struct LayerTiming {
  std::vector<Kernel> kernels;  // one micro-batch's kernels (half batch under kMicroBatch)
  CommCost dispatch, combine;
  // Per-class time of the layer as the GPU sees it: compute kernels counted
  // for both micro-batches, dispatch/combine as exposed (not hidden) time.
  std::array<double, kNumKernelClasses> class_us{};
  double total_us = 0;
  double exposed_comm_us = 0;
};

struct StepResult {
  LayerShape shape;
  LayerTiming moe_layer;    // one MoE layer
  LayerTiming dense_layer;  // one dense layer (when the model has them)
  double head_us = 0;       // lm_head + sampling + step overhead
  double draft_us = 0;      // MTP draft modules
  double step_us = 0;
  double tokens_per_step = 0;    // per request
  double output_tok_s = 0;       // per request
  double throughput_gpu = 0;     // output tokens/s per GPU
  double throughput_node = 0;
  double tokens_per_expert = 0;  // GroupGEMM m
};

LayerTiming layer_timing(const PlanInput& in, double batch, int query_len, bool moe);
StepResult simulate_step(const PlanInput& in);

}  // namespace moelink::plan
