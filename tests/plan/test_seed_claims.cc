// The seed article's figures the planner must reproduce (H100/H200 constants).
#include <gtest/gtest.h>

#include <cmath>

#include "moelink/plan/sweep.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

// Claim 1: single node EP8 DP1 TP8, batch 1, MTP (query length 2): > 100 tok/s.
TEST(PlanSeedClaims, SingleNodeBatchOneAbove100) {
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {8, 1, 8, 8}, 1);
  ASSERT_EQ(in.work.query_len(), 2);
  StepResult r = simulate_step(in);
  EXPECT_GT(r.output_tok_s, 100);
  EXPECT_LT(r.output_tok_s, 300);
  EXPECT_NEAR(r.throughput_node, r.output_tok_s, 1e-9);  // one request per node
}

// Claim 2: at 40-80 tok/s, EP128 on 16 H100 nodes gives several times the
// per-node throughput of one H200 node (seed ~5x; accepted 3-8x).
TEST(PlanSeedClaims, EP128BeatsSingleNodeAtEqualSpeed) {
  SweepSpec one;
  one.eps = {8};
  auto single = sweep(input("deepseek-v3", "h200", "nvlink", {8, 8, 1, 8}, 1), one);
  SweepSpec multi;
  multi.eps = {128};
  auto ep128 = sweep(input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 1), multi);
  auto f1 = pareto_frontier(single), f2 = pareto_frontier(ep128);
  double log_sum = 0, best = 0;
  int n = 0;
  for (double speed = 50; speed <= 80; speed += 10) {
    const double a = frontier_throughput_at(f1, speed), b = frontier_throughput_at(f2, speed);
    ASSERT_GT(a, 0) << speed;
    ASSERT_GT(b, 0) << speed;
    EXPECT_GT(b / a, 2.0) << "at " << speed << " tok/s";
    log_sum += std::log(b / a);
    best = std::max(best, b / a);
    ++n;
  }
  const double geo = std::exp(log_sum / n);
  EXPECT_GE(geo, 3.0);
  EXPECT_LE(geo, 8.0);
  EXPECT_GE(best, 3.0);
  // At 40 tok/s EP128 still wins.
  EXPECT_GT(frontier_throughput_at(f2, 40), frontier_throughput_at(f1, 40));
  // Higher EP shifts the frontier out: EP128 beats EP16 at 60 tok/s.
  SweepSpec e16;
  e16.eps = {16};
  auto f16 = pareto_frontier(sweep(input("deepseek-v3", "h100", "ib-cx7", {16, 16, 1, 8}, 1), e16));
  EXPECT_GT(frontier_throughput_at(f2, 60), frontier_throughput_at(f16, 60));
}

// Claim 3: two micro-batches slow decode below per-GPU batch 32 and speed it
// up by 10-35% at 32 and above (vs dispatch overlap); dispatch overlap alone
// gains about 1% (seed: 16 us of 2667 at batch 128).
TEST(PlanSeedClaims, MicroBatchingAndDispatchOverlap) {
  for (int b : {4, 8, 16, 32, 64, 128}) {
    PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, b, OverlapMode::kDispatchOverlap);
    const double disp = simulate_step(in).step_us;
    in.work.overlap = OverlapMode::kMicroBatch;
    const double mb = simulate_step(in).step_us;
    const double gain = disp / mb - 1;
    if (b < 32) {
      EXPECT_LT(gain, 0) << "batch " << b;
    } else {
      EXPECT_GE(gain, 0.10) << "batch " << b;
      EXPECT_LE(gain, 0.35) << "batch " << b;
    }
  }
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 128, OverlapMode::kNone);
  const StepResult none = simulate_step(in);
  in.work.overlap = OverlapMode::kDispatchOverlap;
  const StepResult disp = simulate_step(in);
  const double g = none.moe_layer.total_us / disp.moe_layer.total_us - 1;
  EXPECT_GT(g, 0.002);
  EXPECT_LT(g, 0.03);
  // Seed's NoOverlap MoE layer at this point: 2667 us.
  EXPECT_NEAR(none.moe_layer.total_us, 2667, 500);
}

// Claim 4 (second half): GroupGEMM stays memory-bound for most swept layouts
// (EP8..EP128, TP1, batch 1..128).
TEST(PlanSeedClaims, GroupGemmMostlyMemoryBound) {
  SweepSpec spec;
  spec.eps = {8, 16, 32, 64, 128};
  spec.tps = {1};
  spec.overlaps = {OverlapMode::kDispatchOverlap};
  spec.skip_unfit = false;
  auto pts = sweep(input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 1), spec);
  ASSERT_EQ(pts.size(), 40u);
  int mem = 0;
  for (const auto& p : pts) mem += p.groupgemm_memory_bound;
  EXPECT_GE(mem, 30);
  EXPECT_LT(mem, 40);  // the largest m do cross the ridge
  for (const auto& p : pts) {
    if (p.layout.ep == 128 && p.work.batch == 128) {
      EXPECT_FALSE(p.groupgemm_memory_bound);
    }
  }
}
