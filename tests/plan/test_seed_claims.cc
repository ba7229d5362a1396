// The seed article's figures the planner must reproduce (H100/H200 constants).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "moelink/plan/memory.h"
#include "moelink/plan/sweep.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

// Claim 1: single node EP8 DP1 TP8, batch 1, MTP (query length 2): > 100 tok/s.
TEST(PlanSeedClaims, SingleNodeBatchOneAbove100) {
  PlanInput in = input("deepseek-v3", "h200", "nvlink-seed", {8, 1, 8, 8}, 1);
  ASSERT_EQ(in.work.query_len(), 2);
  StepResult r = simulate_step(in);
  EXPECT_GT(r.output_tok_s, 100);
  EXPECT_LT(r.output_tok_s, 300);
  EXPECT_NEAR(r.throughput_node, r.output_tok_s, 1e-9);  // one request per node
}

// Claim 2 (issue 5): "At 40-80 tok/s per request, EP128 (16 nodes of H100) gives
// several times (seed: ~5x; accept 3-8x) the per-node throughput of a single H200
// node." Both sides sweep the seed's space (TP 1, 2, 4, 8) with every batch size
// 1..128 per DP group, so the frontier is read at each speed from real
// configurations instead of chords between power-of-two points. The single node
// uses the seed's own NVLink kernels (profile nvlink-seed, docs/planner.md).
namespace {
std::vector<int> every_batch() {
  std::vector<int> v;
  for (int b = 1; b <= 128; ++b) v.push_back(b);
  return v;
}
// One H200 node (EP8, TP 1..8) or 16 H100 nodes (EP128), every batch 1..128.
// gemm_memory > 0 replaces the H200 profile's GEMM memory efficiency.
std::vector<SweepPoint> single_node_points(double gemm_memory = 0, std::vector<int> tps = {1, 2, 4, 8}) {
  SweepSpec spec;
  spec.eps = {8};
  spec.tps = tps;
  spec.batches = every_batch();
  PlanInput in = input("deepseek-v3", "h200", "nvlink-seed", {8, 8, 1, 8}, 1);
  if (gemm_memory > 0) in.gpu.eff.gemm_memory = gemm_memory;
  return sweep(in, spec);
}
std::vector<SweepPoint> ep128_points() {
  SweepSpec spec;
  spec.eps = {128};
  spec.batches = every_batch();
  return sweep(input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 1), spec);
}
// The configuration behind throughput_at_speed(pts, speed).
SweepPoint best_at_speed(const std::vector<SweepPoint>& pts, double speed) {
  SweepPoint best;
  for (const auto& p : pts)
    if (p.output_tok_s >= speed && p.throughput_node > best.throughput_node) best = p;
  return best;
}
}  // namespace

// The bound, [3, 8], at every speed 40..80 tok/s (H200 profile: the
// measured GEMM memory efficiency; 40 tok/s depends on it, see the next test).
TEST(PlanSeedClaims, EP128BeatsSingleNodeAtEqualSpeed) {
  auto single = single_node_points();
  auto ep128 = ep128_points();
  auto f1 = pareto_frontier(single), f2 = pareto_frontier(ep128);
  for (double speed : {40.0, 50.0, 60.0, 70.0, 80.0}) {
    const double a = throughput_at_speed(single, speed), b = throughput_at_speed(ep128, speed);
    ASSERT_GT(a, 0) << "no feasible single-node layout at " << speed << " tok/s";
    ASSERT_GT(b, 0) << "no feasible EP128 layout at " << speed << " tok/s";
    // The frontier read as a curve agrees with the exact sweep within 10%.
    EXPECT_NEAR(frontier_throughput_at(f1, speed) / a, 1.0, 0.1) << speed;
    EXPECT_NEAR(frontier_throughput_at(f2, speed) / b, 1.0, 0.1) << speed;
    const double ratio = b / a;
    std::printf("claim 2: %.0f tok/s: single %.0f, EP128 %.0f tok/s per node, %.2fx\n", speed, a, b, ratio);
    EXPECT_GE(ratio, 3.0) << "at " << speed << " tok/s";
    EXPECT_LE(ratio, 8.0) << "at " << speed << " tok/s";
  }
  // Seed: at 64 requests per GPU (TP1) the single node is slightly ahead of
  // EP128 in throughput per node (NVLink vs IB).
  auto at = [](const std::vector<SweepPoint>& pts, int tp, int b) {
    double best = 0;
    for (const auto& p : pts)
      if (p.layout.tp == tp && p.work.batch == b) best = std::max(best, p.throughput_node);
    return best;
  };
  const double s64 = at(single, 1, 64), m64 = at(ep128, 1, 64);
  EXPECT_GT(s64, m64);
  EXPECT_LT(s64, 1.25 * m64);
  // Higher EP shifts the frontier out: EP128 beats EP16 at 60 tok/s.
  SweepSpec e16;
  e16.eps = {16};
  auto f16 = pareto_frontier(sweep(input("deepseek-v3", "h100", "ib-cx7", {16, 16, 1, 8}, 1), e16));
  EXPECT_GT(frontier_throughput_at(f2, 60), frontier_throughput_at(f16, 60));
}

// 40 tok/s is the single H200 node's knee, so claim 2 there hinges on the
// H200's GEMM memory efficiency (docs/planner.md, "Claim 2 at 40 tok/s"): with
// the measured 0.66 (bench/results/2026-12-01_nvidia-h200_grouped-gemm-fp8.json)
// the ratio is >= 3, with the 0.75 taken from the seed's H100 kernel it is ~2x.
// These are the numbers the doc quotes; if one moves, update the doc with it.
TEST(PlanSeedClaims, Claim2At40HingesOnH200GemmEfficiency) {
  const PlanInput h200 = input("deepseek-v3", "h200", "nvlink-seed", {8, 8, 1, 8}, 1);
  ASSERT_NEAR(h200.gpu.eff.gemm_memory, 0.66, 1e-9) << "the H200 profile's value is the measurement";
  const double h100_eff = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 1).gpu.eff.gemm_memory;
  ASSERT_NEAR(h100_eff, 0.75, 1e-9);

  auto ep128 = ep128_points();
  const double b = throughput_at_speed(ep128, 40);
  ASSERT_GT(b, 0);
  auto measured = single_node_points();
  auto borrowed = single_node_points(h100_eff);
  const double a_measured = throughput_at_speed(measured, 40), a_borrowed = throughput_at_speed(borrowed, 40);
  ASSERT_GT(a_measured, 0);
  ASSERT_GT(a_borrowed, 0);
  EXPECT_GE(b / a_measured, 3.0);
  EXPECT_LE(b / a_measured, 4.5);
  EXPECT_GE(b / a_borrowed, 1.8);
  EXPECT_LT(b / a_borrowed, 2.5);

  // Sensitivity (the doc's table): the ratio at 40 tok/s falls monotonically
  // as the H200's GEMMs get more efficient; EP128 (H100) does not move.
  double prev = 1e9;
  for (double eff : {0.62, 0.647, 0.66, 0.694, 0.70, 0.75}) {
    const double r = b / throughput_at_speed(single_node_points(eff), 40);
    std::printf("claim 2 at 40 tok/s, H200 gemm_memory %.3f: %.2fx\n", eff, r);
    EXPECT_LT(r, prev) << eff;
    prev = r;
  }

  // The knee: a 12% slower weight stream (0.75 -> 0.66) costs the single node
  // far more throughput at 40 tok/s than at 60 tok/s, and the fastest single-node
  // point reaching a third of EP128's 40 tok/s throughput lies within a few
  // percent of 40 tok/s, below it with 0.66 and above it with 0.75.
  const double loss40 = 1 - a_measured / a_borrowed;
  const double loss60 = 1 - throughput_at_speed(measured, 60) / throughput_at_speed(borrowed, 60);
  std::printf("single node, 0.75 -> 0.66: -%.0f%% at 40 tok/s, -%.0f%% at 60 tok/s\n", 100 * loss40, 100 * loss60);
  EXPECT_GT(loss40, 0.35);
  EXPECT_GT(loss40, 2 * loss60);
  auto knee = [&](const std::vector<SweepPoint>& pts) {
    double s = 0;
    for (const auto& p : pts)
      if (p.throughput_node >= b / 3) s = std::max(s, p.output_tok_s);
    return s;
  };
  const double knee_measured = knee(measured), knee_borrowed = knee(borrowed);
  std::printf("a third of EP128 at 40 tok/s: up to %.1f tok/s (0.66), %.1f tok/s (0.75)\n", knee_measured,
              knee_borrowed);
  EXPECT_GT(knee_measured, 37);
  EXPECT_LT(knee_measured, 40);
  EXPECT_GT(knee_borrowed, 40);
  EXPECT_LT(knee_borrowed, 44);

  // At either efficiency the single node's best configuration at 40 tok/s is a
  // DP layout (not DP1 TP8), streams nearly all 32 local experts every step
  // (GroupGEMM is most of the MoE layer) and is far from its KV capacity:
  // neither memory nor the layout choice caps it.
  for (double eff : {h200.gpu.eff.gemm_memory, h100_eff}) {
    const SweepPoint s = best_at_speed(eff == h100_eff ? borrowed : measured, 40);
    EXPECT_GT(s.layout.dp, 1) << eff;
    PlanInput in = input("deepseek-v3", "h200", "nvlink-seed", s.layout, s.work.batch, s.work.overlap);
    in.gpu.eff.gemm_memory = eff;
    const StepResult r = simulate_step(in);
    EXPECT_NEAR(r.output_tok_s, s.output_tok_s, 1e-9) << eff;
    EXPECT_GE(r.shape.active_experts, 0.95 * r.shape.local_experts) << eff;
    const MemoryReport mem = memory_report(in.model, in.gpu, in.layout, in.work);
    ASSERT_TRUE(mem.fits()) << eff;
    EXPECT_LE(3 * s.work.batch, mem.max_batch) << eff;
    double groupgemm = 0;
    for (const auto& k : r.moe_layer.kernels)
      if (k.cls == KernelClass::kGroupGemm) groupgemm += k.time_us;
    EXPECT_GT(groupgemm, 0.5 * r.moe_layer.total_us) << eff;
    std::printf("single node at 40 tok/s, gemm_memory %.2f: EP%d DP%d TP%d batch %d, %.1f tok/s, %.0f tok/s per node, "
                "%.1f of %.0f experts, GroupGEMM %.0f of %.0f us, max batch %d\n",
                eff, s.layout.ep, s.layout.dp, s.layout.tp, s.work.batch, s.output_tok_s, s.throughput_node,
                r.shape.active_experts, r.shape.local_experts, groupgemm, r.moe_layer.total_us, mem.max_batch);
  }
}

// The seed's EP8 vs EP128 layer breakdown (H100, TP1, batch 128 per GPU, q2,
// KV 5000). Its EP8 bar is one batch, not micro-batched: the seed groups it with
// the EP128 NoOverlap and DispatchOverlap bars as having the same non-MoE
// kernels, lists the micro-batch kernel increase as a difference between EP8 and
// EP128 MicroBatch, and its EP8 GroupGEMM (555 us) is one read of the 32 local
// experts' 1.41 GB (two would need 5.1 TB/s on a 3.35 TB/s GPU). The nvlink-seed
// profile is calibrated on this bar (docs/planner.md, "Departures").
TEST(PlanSeedClaims, SeedEP8BarIsOneBatch) {
  PlanInput in = input("deepseek-v3", "h100", "nvlink-seed", {8, 8, 1, 8}, 128, OverlapMode::kNone);
  const LayerTiming one = simulate_step(in).moe_layer;
  const double comm = one.class_us[int(KernelClass::kDispatch)] + one.class_us[int(KernelClass::kCombine)];
  const double groupgemm = one.class_us[int(KernelClass::kGroupGemm)];
  EXPECT_NEAR(one.total_us, 1802, 0.03 * 1802);  // seed: 1802 us
  EXPECT_NEAR(comm, 604 - 213, 0.02 * 391);      // seed: EP128's 367 + 237, minus 213
  // The model is not optimistic about single-node weight streaming: the seed's
  // 555 us is, if anything, faster (taking it literally lowers claim 2 at 40 tok/s).
  EXPECT_GE(groupgemm, 555);
  EXPECT_LE(groupgemm, 1.1 * 555);
  // Read as micro-batched, the bar cannot be matched: the weights are read twice.
  in.work.overlap = OverlapMode::kMicroBatch;
  const LayerTiming mb = simulate_step(in).moe_layer;
  EXPECT_GT(mb.class_us[int(KernelClass::kGroupGemm)], 2 * 555);
  EXPECT_GT(mb.total_us, 1.3 * 1802);
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
