#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "moelink/plan/calibration.h"
#include "moelink/plan/report.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
const char* kBench = R"({"machine": "m", "date": "d", "world_size": 2,
  "config": {"hidden_dim": 7168, "num_experts": 256, "experts_per_token": 8},
  "results": [
   {"tokens": 128, "quantities": {"dispatch": {"p50_us": 25.0}, "combine": {"p50_us": 20.0}}},
   {"tokens": 1, "quantities": {"dispatch": {"p50_us": 15.0}, "combine": {"p50_us": 13.0}}},
   {"tokens": 4096, "quantities": {"dispatch": {"p50_us": 170.0}, "combine": {"p50_us": 275.0}}}]})";
}

TEST(PlanCalibration, ParsesAndInterpolates) {
  Calibration c = Calibration::from_json_text(kBench, "t");
  ASSERT_EQ(c.samples.size(), 3u);
  EXPECT_EQ(c.samples[0].tokens, 1);
  EXPECT_DOUBLE_EQ(c.dispatch_us(1), 15);
  EXPECT_DOUBLE_EQ(c.dispatch_us(0.5), 15);
  EXPECT_DOUBLE_EQ(c.combine_us(128), 20);
  const double mid = c.dispatch_us(std::sqrt(128.0));  // log-log midpoint
  EXPECT_NEAR(mid, std::sqrt(15.0 * 25.0), 1e-9);
  EXPECT_GT(c.combine_us(8192), 275);
  EXPECT_TRUE(c.applies(2, 7168));
  EXPECT_FALSE(c.applies(8, 7168));
  EXPECT_THROW(Calibration::from_json_text("{\"results\": []}", "x"), PlanError);
  EXPECT_THROW(Calibration::from_json_text("[", "x"), PlanError);
}

TEST(PlanCalibration, RealBenchFileReplacesTheModel) {
  Calibration c = Calibration::from_file(std::string(MOELINK_SOURCE_DIR) + "/bench/results/2026-11-30_nvidia-h200-x2.json");
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.hidden_dim, 7168);
  EXPECT_EQ(c.machine, "nvidia-h200-x2");
  EXPECT_EQ(c.samples.size(), 3u);
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {2, 2, 1, 8}, 64);
  in.work.draft_tokens = 1;  // 128 tokens per rank
  StepResult model = simulate_step(in);
  in.calibration = &c;
  StepResult meas = simulate_step(in);
  EXPECT_FALSE(model.moe_layer.dispatch.measured);
  EXPECT_TRUE(meas.moe_layer.dispatch.measured);
  EXPECT_NEAR(meas.moe_layer.dispatch.total_us(), c.dispatch_us(128), 1e-6);
  EXPECT_NEAR(meas.moe_layer.combine.total_us(), c.combine_us(128), 1e-6);
  // Not applied to another EP size.
  in.layout = {8, 8, 1, 8};
  EXPECT_FALSE(simulate_step(in).moe_layer.dispatch.measured);
  // Model vs measurement report: one row per bench point, same order of magnitude.
  auto rows = compare_calibration(in, c);
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& r : rows) {
    EXPECT_GT(r.dispatch_model_us / r.dispatch_measured_us, 0.25) << r.tokens;
    EXPECT_LT(r.dispatch_model_us / r.dispatch_measured_us, 4) << r.tokens;
  }
  EXPECT_NE(format_calibration(rows, c).find("nvidia-h200-x2"), std::string::npos);
}
