// moelink-plan: terminal table, JSON and CSV output.
#pragma once
#include <string>
#include <vector>

#include "moelink/plan/calibration.h"
#include "moelink/plan/memory.h"
#include "moelink/plan/sweep.h"

namespace moelink::plan {

std::string format_step_table(const PlanInput& in, const StepResult& r, const MemoryReport& mem);
std::string step_json(const PlanInput& in, const StepResult& r, const MemoryReport& mem);
std::string step_csv(const PlanInput& in, const StepResult& r);  // one row per kernel

std::string format_sweep_table(const std::vector<SweepPoint>& pts);
// "frontiers" are keyed "EP8" (one GPU type) or "EP8 on H200-SXM" (several);
// "skipped" lists what the sweep left out and why.
std::string sweep_json(const std::vector<SweepPoint>& pts, const std::vector<SkippedLayout>& skipped = {});
// One row per point; 'pareto' is 1 on its (GPU, EP) frontier.
std::string sweep_csv(const std::vector<SweepPoint>& pts);
// "Left out of the sweep (N):" and one line per skipped layout; "" when none.
std::string format_skipped(const std::vector<SkippedLayout>& skipped);

// Model vs measurement for each bench sample (layout EP = DP = world size).
struct CalibrationRow {
  double tokens, dispatch_model_us, dispatch_measured_us, combine_model_us, combine_measured_us;
};
std::vector<CalibrationRow> compare_calibration(const PlanInput& base, const Calibration& c);
std::string format_calibration(const std::vector<CalibrationRow>& rows, const Calibration& c);

}  // namespace moelink::plan
