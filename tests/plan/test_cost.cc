#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

TEST(PlanCost, GemmFlopsAndBytes) {
  GpuProfile g = store().gpu("h100");
  Kernel k = gemm_kernel("x", 1, 128, 7168, 2048, 1, 1, g);
  EXPECT_DOUBLE_EQ(k.flops, 2.0 * 128 * 7168 * 2048);
  EXPECT_DOUBLE_EQ(k.bytes, 7168.0 * 2048 + 128.0 * 7168 + 128.0 * 2048 * 2);
  EXPECT_TRUE(k.memory_bound);
  const double tm = k.bytes / (g.hbm_gbps * 1e9 * g.eff.gemm_memory) * 1e6;
  EXPECT_NEAR(k.time_us, tm + g.eff.kernel_overhead_us, 1e-9);
  Kernel big = gemm_kernel("y", 1, 65536, 7168, 7168, 1, 1, g);
  EXPECT_FALSE(big.memory_bound);
  EXPECT_NEAR(big.time_us - g.eff.kernel_overhead_us, big.flops / (g.fp8_tflops * 1e12 * g.eff.gemm_compute) * 1e6,
              1e-6);
}

TEST(PlanCost, GroupGemmFlopsAndBytes) {
  GpuProfile g = store().gpu("h100");
  Kernel k = group_gemm_kernel("gg", 4, 2, 2, 1024, 7168, 4096, 1, g);
  EXPECT_DOUBLE_EQ(k.flops, 2.0 * 2 * 1024 * 7168 * 4096);
  EXPECT_DOUBLE_EQ(k.bytes, 2.0 * (1024.0 * 7168 + 7168.0 * 4096 + 1024.0 * 4096 * 2));
  EXPECT_EQ(k.cls, KernelClass::kGroupGemm);
}

// Claim 4: EP128 DP128, batch 128, query length 2, top-8 of 256 -> m = 1024.
TEST(PlanSeedClaims, GroupGemmTokensPerExpert) {
  auto s = store();
  ModelSpec m = s.model("deepseek-v3");
  LayerShape sh = layer_shape(m, {128, 128, 1, 8}, 128, 2);
  EXPECT_DOUBLE_EQ(sh.tokens_per_expert, 1024);
  EXPECT_DOUBLE_EQ(sh.local_experts, 2);
  EXPECT_DOUBLE_EQ(layer_shape(m, {8, 8, 1, 8}, 128, 2).tokens_per_expert, 64);
  // Batch 1 at EP8 DP1 TP8: 2 tokens reach at most 16 experts, about 2 per GPU.
  LayerShape one = layer_shape(m, {8, 1, 8, 8}, 1, 2);
  EXPECT_NEAR(one.active_experts, 2.0, 0.1);
}

TEST(PlanCost, KernelListCoversTheSeedClasses) {
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 128);
  auto ks = layer_compute_kernels(in.model, in.gpu, in.layout, 128, 2, 5000, true);
  std::set<KernelClass> seen;
  for (const auto& k : ks) {
    seen.insert(k.cls);
    EXPECT_GT(k.time_us, 0) << k.name;
    EXPECT_GE(k.stage, 1);
    EXPECT_LE(k.stage, 5);
  }
  for (KernelClass c : {KernelClass::kNorm, KernelClass::kGemm, KernelClass::kBmm, KernelClass::kAttention,
                        KernelClass::kRouter, KernelClass::kGroupGemm})
    EXPECT_TRUE(seen.count(c)) << to_string(c);
  // MLA reads each request's latent KV once: 128 x 5000 x 576 x 2 bytes.
  for (const auto& k : ks) {
    if (k.cls == KernelClass::kAttention) {
      EXPECT_GE(k.bytes, 128.0 * 5000 * 576 * 2);
    }
  }
}

TEST(PlanCost, DispatchBytesAndSplit) {
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 128);
  LayerShape sh = layer_shape(in.model, in.layout, 128, 2);
  EXPECT_DOUBLE_EQ(dispatch_row_bytes(in.model), 7168 + 56 * 4);  // fp8 + scales, as moelink-bench
  EXPECT_GT(sh.dest_ranks, 7.5);
  EXPECT_LE(sh.dest_ranks, 8.0);
  CommCost d = dispatch_cost(in.model, in.gpu, in.net, in.layout, sh);
  CommCost c = combine_cost(in.model, in.gpu, in.net, in.layout, sh);
  EXPECT_NEAR(d.bytes_network + d.bytes_nvlink, 256 * (sh.dest_ranks * 127.0 / 128) * 7392, 1);
  EXPECT_NEAR(c.bytes_network / d.bytes_network, 14336.0 / 7392, 1e-9);
  // Seed, per MoE layer at this point without overlap: dispatch 593 us, combine 1012 us.
  EXPECT_NEAR(d.total_us(), 593, 150);
  EXPECT_NEAR(c.total_us(), 1012, 300);
}
