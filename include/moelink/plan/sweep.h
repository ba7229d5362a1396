// moelink-plan: sweeps over layouts and batch sizes, Pareto frontiers.
#pragma once
#include <map>
#include <vector>

#include "moelink/plan/memory.h"
#include "moelink/plan/step.h"

namespace moelink::plan {

struct SweepPoint {
  Layout layout;
  Workload work;
  std::string gpu;
  double output_tok_s = 0;
  double throughput_node = 0;
  double throughput_gpu = 0;
  double step_us = 0;
  double tokens_per_expert = 0;
  bool groupgemm_memory_bound = true;
  bool fits = true;
};

struct SweepSpec {
  std::vector<int> eps{8};
  std::vector<int> tps{1, 2, 4, 8};
  std::vector<int> batches{1, 2, 4, 8, 16, 32, 64, 128};
  // Overlap modes tried at each point (an engine picks the faster per batch size).
  std::vector<OverlapMode> overlaps{OverlapMode::kDispatchOverlap, OverlapMode::kMicroBatch};
  bool skip_unfit = true;
};

// All (EP, TP, batch) points of `spec` with DP = EP / TP. `base` gives the model,
// hardware and workload; its layout's gpus_per_node is kept.
std::vector<SweepPoint> sweep(const PlanInput& base, const SweepSpec& spec);

// Points not dominated in (output speed, throughput per node), sorted by speed.
std::vector<SweepPoint> pareto_frontier(std::vector<SweepPoint> pts);
// One frontier per EP size.
std::map<int, std::vector<SweepPoint>> frontiers_by_ep(const std::vector<SweepPoint>& pts);
// Best throughput per node among points at least `speed` tok/s fast (0 if none).
double throughput_at_speed(const std::vector<SweepPoint>& pts, double speed);
// Frontier read as a curve: log-throughput interpolated linearly in speed between
// frontier points (batch sizes between the swept ones exist); 0 beyond the fastest point.
double frontier_throughput_at(const std::vector<SweepPoint>& frontier, double speed);

}  // namespace moelink::plan
