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
std::string sweep_json(const std::vector<SweepPoint>& pts);
std::string sweep_csv(const std::vector<SweepPoint>& pts);

// Model vs measurement for each bench sample (layout EP = DP = world size).
struct CalibrationRow {
  double tokens, dispatch_model_us, dispatch_measured_us, combine_model_us, combine_measured_us;
};
std::vector<CalibrationRow> compare_calibration(const PlanInput& base, const Calibration& c);
std::string format_calibration(const std::vector<CalibrationRow>& rows, const Calibration& c);

}  // namespace moelink::plan
