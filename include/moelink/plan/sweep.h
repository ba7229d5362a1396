// moelink-plan: sweeps over layouts and batch sizes, Pareto frontiers.
#pragma once
#include <map>
#include <string>
#include <utility>
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

// A layout, or some of its batch sizes, that a sweep left out, and why. A
// sweep's user sees what is missing from the frontier instead of wondering.
struct SkippedLayout {
  std::string gpu;
  int ep = 0;
  int tp = 0;                // 0: every swept TP size (the EP size itself is unusable)
  int dp = 0;                // EP / TP when the split is valid, else 0
  std::vector<int> batches;  // batch sizes left out (every swept one for a whole layout)
  bool whole_layout = true;  // false: only `batches` did not fit in memory
  std::string reason;
  std::string str() const;   // "EP8 DP8 TP1 on H100-SXM: <reason>"
};

// All (EP, TP, batch) points of `spec` with DP = EP / TP. `base` gives the model,
// hardware and workload; its layout's gpus_per_node is kept. Invalid layouts and
// points that do not fit in memory (when spec.skip_unfit) are left out; with
// `skipped` each of them is listed there with the reason. Throws PlanError for
// sizes below 1 in `spec` (nonsense points, not layouts to leave out).
std::vector<SweepPoint> sweep(const PlanInput& base, const SweepSpec& spec,
                              std::vector<SkippedLayout>* skipped = nullptr);

// Points not dominated in (output speed, throughput per node), sorted by speed.
std::vector<SweepPoint> pareto_frontier(std::vector<SweepPoint> pts);
// One frontier per EP size (points of one GPU type).
std::map<int, std::vector<SweepPoint>> frontiers_by_ep(const std::vector<SweepPoint>& pts);
// One frontier per (GPU name, EP size): a sweep over several GPU types keeps
// each GPU's points apart, since their nodes are different machines.
using FrontierKey = std::pair<std::string, int>;
std::map<FrontierKey, std::vector<SweepPoint>> frontiers_by_gpu_and_ep(const std::vector<SweepPoint>& pts);
// "EP128", or "EP128 on H100-SXM" when the sweep spans several GPU types.
std::string frontier_name(const FrontierKey& k, bool with_gpu);
// Number of distinct GPU types among the points.
int count_gpus(const std::vector<SweepPoint>& pts);
// Best throughput per node among points at least `speed` tok/s fast (0 if none).
double throughput_at_speed(const std::vector<SweepPoint>& pts, double speed);
// Frontier read as a curve: log-throughput interpolated linearly in speed between
// frontier points (batch sizes between the swept ones exist); 0 beyond the fastest point.
double frontier_throughput_at(const std::vector<SweepPoint>& frontier, double speed);

}  // namespace moelink::plan
