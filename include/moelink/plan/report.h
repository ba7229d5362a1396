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

// Model vs measurement at each measured token count, layout EP = DP = world
// size, TP1: one row per measured kernel (Calibration::measured_name:
// "dispatch", "combine", "router", "shared_expert", ...) and a "sum" row.
struct CalibrationRow {
  double tokens = 0;  // per rank
  std::string mode;   // layer bench: overlap mode of the measured run
  std::string kernel;
  double model_us = 0, measured_us = 0;
};
std::vector<CalibrationRow> compare_calibration(const PlanInput& base, const Calibration& c);
// The rows as a table with the ratio measured / modelled.
// ep: the EP a stand-in file (Calibration::stand_in_ep) was compared at; 0: the file's world size.
std::string format_calibration(const std::vector<CalibrationRow>& rows, const Calibration& c, int ep = 0);

}  // namespace moelink::plan
