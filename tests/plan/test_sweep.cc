#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "moelink/plan/sweep.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
SweepPoint pt(double speed, double thr, int ep = 8) {
  SweepPoint p;
  p.layout.ep = ep;
  p.output_tok_s = speed;
  p.throughput_node = thr;
  return p;
}
}  // namespace

TEST(PlanPareto, KeepsOnlyNonDominated) {
  auto f = pareto_frontier({pt(10, 1000), pt(20, 800), pt(15, 700), pt(30, 100), pt(25, 100), pt(5, 900)});
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[0].output_tok_s, 10);
  EXPECT_EQ(f[1].output_tok_s, 20);
  EXPECT_EQ(f[2].output_tok_s, 30);
  EXPECT_TRUE(pareto_frontier({}).empty());
}

TEST(PlanPareto, PerEpAndLookups) {
  std::vector<SweepPoint> pts{pt(10, 1000, 8), pt(20, 500, 8), pt(10, 3000, 128), pt(40, 900, 128)};
  auto by = frontiers_by_ep(pts);
  ASSERT_EQ(by.size(), 2u);
  EXPECT_EQ(by[128].size(), 2u);
  EXPECT_DOUBLE_EQ(throughput_at_speed(pts, 15), 900);
  EXPECT_DOUBLE_EQ(throughput_at_speed(pts, 50), 0);
  // Log-linear between (10, 1000) and (20, 500): sqrt(1000 * 500) at 15.
  EXPECT_NEAR(frontier_throughput_at(by[8], 15), std::sqrt(1000.0 * 500), 1e-6);
  EXPECT_DOUBLE_EQ(frontier_throughput_at(by[8], 5), 1000);
  EXPECT_DOUBLE_EQ(frontier_throughput_at(by[8], 25), 0);
}

TEST(PlanSweep, SkipsInvalidAndUnfit) {
  SweepSpec spec;
  spec.eps = {8};
  spec.tps = {1, 2, 16};
  spec.batches = {1, 128};
  spec.overlaps = {OverlapMode::kDispatchOverlap};
  auto pts = sweep(input("deepseek-v3", "h200", "nvlink", {8, 8, 1, 8}, 1), spec);
  for (const auto& p : pts) {
    EXPECT_NE(p.layout.tp, 16);
    EXPECT_TRUE(p.fits);
    EXPECT_FALSE(p.layout.tp == 1 && p.work.batch == 128);  // does not fit on H200
  }
  EXPECT_EQ(pts.size(), 2u);  // TP1 and TP2 at batch 1; batch 128 fits at neither
  // Over NVLink only, EP16 is not a valid layout.
  spec.eps = {16};
  EXPECT_TRUE(sweep(input("deepseek-v3", "h200", "nvlink", {8, 8, 1, 8}, 1), spec).empty());
}

TEST(PlanStep, MonotoneInBatchAndMtp) {
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {64, 64, 1, 8}, 8);
  StepResult a = simulate_step(in);
  in.work.batch = 64;
  StepResult b = simulate_step(in);
  EXPECT_GT(b.step_us, a.step_us);
  EXPECT_GT(b.throughput_node, a.throughput_node);
  EXPECT_LT(b.output_tok_s, a.output_tok_s);
  EXPECT_DOUBLE_EQ(b.tokens_per_step, 1.6);
  in.work.batch = 8;
  in.work.draft_tokens = 0;
  StepResult c = simulate_step(in);
  EXPECT_DOUBLE_EQ(c.tokens_per_step, 1);
  EXPECT_GT(a.output_tok_s, c.output_tok_s);  // at small batch MTP at 60% acceptance pays off
  Workload w;
  w.draft_tokens = 2;
  w.acceptance = 0.5;
  EXPECT_DOUBLE_EQ(w.tokens_per_step(), 1.75);
}

TEST(PlanStep, OtherModelsRun) {
  for (const char* m : {"kimi-k2", "qwen3-235b-a22b", "mixtral-8x7b"}) {
    PlanInput in = input(m, "h200", "nvlink", {8, 8, 1, 8}, 16);
    in.work.draft_tokens = 0;
    StepResult r = simulate_step(in);
    EXPECT_GT(r.output_tok_s, 5) << m;
    EXPECT_LT(r.output_tok_s, 1000) << m;
  }
}
