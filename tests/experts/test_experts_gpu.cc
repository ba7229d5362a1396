// The expert kernels on ExpertDevice::kCUDA (CUTLASS's Hopper grouped GEMM
// and moelink's quantization kernels), through the same cases and reference
// as the CPU tests, plus CUDA-graph capture and replay with new counts.
// Every test skips itself without a GPU. These tests use CUDA in the test
// process itself, so they live in their own binary (moelink_experts_tests),
// apart from the all-to-all tests that fork ranks.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "experts/cuda/block_scaled_gemm.h"
#include "experts/cuda/dense_stream_k_gemm.h"
#include "experts/expert_cases.h"
#include "experts/expert_reference.h"
#include "gpu_memory_ops.h"
#include "moelink/errors.h"
#include "ref_dtype.h"

namespace moelink_test {
namespace {

using moelink::DType;
using moelink::ExpertDevice;
using moelink::Tensor;

bool has_hopper_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
         major == 9;
}

#define REQUIRE_HOPPER()                                                                   \
  do {                                                                                     \
    if (!has_hopper_gpu())                                                                 \
      GTEST_SKIP() << "no Hopper GPU on this machine: the CUDA expert kernels run on the " \
                      "H200 device machine (tools/gpu_check.sh)";                          \
  } while (0)

// Experts::create with the environment variable `var` set to `bad` must
// throw InvalidArgument naming "<var> = '<bad>'" followed by `rule`.
void expect_setting_rejected(const char* var, const char* bad, const std::string& rule) {
  moelink::ExpertConfig c;
  c.num_experts = 1, c.max_rows = 1, c.hidden_dim = 128, c.intermediate_dim = 128;
  setenv(var, bad, 1);
  try {
    moelink::Experts::create(c);
    ADD_FAILURE() << var << "=" << bad << " was accepted";
  } catch (const moelink::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(std::string(var) + " = '" + bad + "'" + rule), std::string::npos)
        << e.what();
  }
  unsetenv(var);
}

class GpuExperts : public ::testing::TestWithParam<ExpertCase> {
 protected:
  void SetUp() override {
    REQUIRE_HOPPER();
    ops_ = std::make_unique<GpuMemoryOps>(0);
  }
  std::unique_ptr<GpuMemoryOps> ops_;
};

TEST_P(GpuExperts, GroupedGemmMatchesReference) { run_grouped_gemm_case(ExpertDevice::kCUDA, *ops_, GetParam()); }
TEST_P(GpuExperts, SiluMulQuantMatchesReference) { run_silu_mul_quant_case(ExpertDevice::kCUDA, *ops_, GetParam()); }
TEST_P(GpuExperts, ForwardMatchesReference) { run_forward_case(ExpertDevice::kCUDA, *ops_, GetParam()); }

// Every case with each default tile configuration: expected_rows 16
// (swapped operands), 48 (64-row tiles), 128 (128-row tiles) and 256
// (128-row tiles in clusters of 2).
std::vector<ExpertCase> gpu_cases() {
  std::vector<ExpertCase> out;
  for (ExpertCase c : expert_cases()) {
    for (int64_t rows : {16, 48, 128, 256}) {
      c.expected_rows = rows;
      out.push_back(c);
    }
  }
  // Larger groups: several tiles along M, a partial last tile.
  out.push_back({{"Rows300", 2, 300, 512, 256}, CountPattern::kRandom, 128});
  out.push_back({{"Rows300", 2, 300, 512, 256}, CountPattern::kFull, 16});
  out.push_back({{"Rows300", 2, 300, 512, 256}, CountPattern::kRandom, 48});
  out.push_back({{"Rows300", 2, 300, 512, 256}, CountPattern::kRandom, 300});
  out.push_back({{"Rows300", 3, 300, 512, 256}, CountPattern::kSkewed, 300});
  // Swapped-operand GEMMs with several tiles per CTA, the later ones handed
  // out by the dynamic scheduler (GEMM2: 16 experts x 32 tiles on 128
  // CTAs), with empty experts (random counts include 0; skewed: one expert
  // only, so most CTAs find no tile at all).
  for (CountPattern p : {CountPattern::kRandom, CountPattern::kSkewed, CountPattern::kOne})
    out.push_back({{"ManyTiles", 16, 32, 4096, 256}, p, 16});
  // One object made for 300 rows, calls naming fewer (the MoE layer's
  // decode steps under a large max_tokens): each row class's tiles (and
  // split over K where its tiles are few) on counts up to the capacity,
  // beyond what the call expected; names above the config's count as it.
  for (int64_t call : {1, 2, 33, 64, 100, 256, 1000})
    out.push_back({{"Rows300", 3, 300, 512, 256}, CountPattern::kRandom, 300, call});
  out.push_back({deepseek_shape(), CountPattern::kTop8, 0, 1});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuExperts, ::testing::ValuesIn(gpu_cases()),
                         [](const auto& info) { return info.param.name(); });

// Every tile configuration in this build (MOELINK_EXPERTS_TILES forces one;
// a build with -DMOELINK_EXPERTS_TILE_SWEEP=ON has the candidates too),
// through the grouped and the dense GEMM.
TEST(GpuExpertsTiles, EveryBuiltConfigurationMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  int built = 0;
  for (const char* name : {"swap128n32", "rows64", "rows128", "rows128c2", "rows64plain",
                           "rows128plain"}) {
    SCOPED_TRACE(name);
    setenv("MOELINK_EXPERTS_TILES", name, 1);
    try {
      moelink::ExpertConfig probe;
      probe.num_experts = 1, probe.max_rows = 1, probe.hidden_dim = 128, probe.intermediate_dim = 128;
      moelink::Experts::create(probe);
    } catch (const moelink::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("MOELINK_EXPERTS_TILES"), std::string::npos) << e.what();
      continue;  // not in this build
    }
    ++built;
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {{"Rows300", 3, 300, 512, 256}, CountPattern::kRandom});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {small_shape(), CountPattern::kOne});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {deepseek_shape(), CountPattern::kTop8});
    run_forward_case(ExpertDevice::kCUDA, ops, {small_shape(), CountPattern::kTop8});
    run_gemm_case(ExpertDevice::kCUDA, ops, 33, 384, 256, 17);
  }
  unsetenv("MOELINK_EXPERTS_TILES");
  EXPECT_GE(built, 4) << "the default configurations swap128n32, rows64, rows128 and rows128c2 must be built";
}

// The split over K (MOELINK_EXPERTS_SPLIT_K forces it on the swapped-operand
// tiles and a dense GEMM's row tiles; auto splits only swapped-operand
// GEMMs with few tiles, like the dense m = 1 case in GpuExpertsDense): slice counts that
// divide DeepSeek-V3's 56 k-blocks or not, the grouped and dense GEMMs (on
// the swapped-operand tiles and the 128-row split kernel, one partial row
// tile, a bound inside it), forward, clamped counts. A slice count that
// does not divide K/128 leaves that GEMM whole (Qwen3's I = 1536 has 12
// k-blocks; 7 divides neither 8 nor 12).
TEST(GpuExpertsSplitK, EverySplitMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  // The dense GEMMs without a bound would split in one kernel instead
  // (GpuExpertsDenseStreamK below).
  setenv("MOELINK_EXPERTS_STREAM_K", "off", 1);
  for (const char* split : {"2", "3", "4", "7", "8"}) {
    SCOPED_TRACE(std::string("MOELINK_EXPERTS_SPLIT_K=") + split);
    setenv("MOELINK_EXPERTS_SPLIT_K", split, 1);
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {deepseek_shape(), CountPattern::kTop8, 16});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {qwen3_shape(), CountPattern::kSkewed, 16});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {deepseek_shape(), CountPattern::kZero, 16});
    run_forward_case(ExpertDevice::kCUDA, ops, {deepseek_shape(), CountPattern::kOne, 16});
    run_forward_case(ExpertDevice::kCUDA, ops, {qwen3_shape(), CountPattern::kRandom, 16});
    run_gemm_case(ExpertDevice::kCUDA, ops, 5, 256, 1024, 3);
    run_gemm_case(ExpertDevice::kCUDA, ops, 2, 2 * 2048, 7168, 1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 48, 384, 7168, -1);    // 64-row tiles, split on 128-row ones
    run_gemm_case(ExpertDevice::kCUDA, ops, 200, 640, 7168, 131);  // two row tiles, the bound in the second
    run_gemm_case(ExpertDevice::kCUDA, ops, 129, 256, 3072, 0);    // no rows at all
    run_out_of_range_case(ExpertDevice::kCUDA, ops);
  }
  for (const char* bad : {"9", "0", "12", "four"})
    expect_setting_rejected("MOELINK_EXPERTS_SPLIT_K", bad, " must be auto or 1 to 8");
  unsetenv("MOELINK_EXPERTS_STREAM_K");
}

// split_k_for's choices on DeepSeek-V3's shapes (host arithmetic: runs
// without a GPU), on an H100's / H200's 132 SMs: the shared expert's GEMM1
// in 4 slices and its GEMM2 whole (experts_bench.py --split-k measured
// both); the merged qkv_a's 17 weight tiles at 1-32 rows in 4; o_proj (56
// tiles, 128 k-blocks) at 1 row in 2; 8 experts whole; no tiles whole.
TEST(ExpertsSplitK, SliceCountsForDeepSeekShapes) {
  using moelink::detail::experts::split_k_for;
  EXPECT_EQ(split_k_for(32, 56, 132), 4);
  EXPECT_EQ(split_k_for(56, 16, 132), 1);
  EXPECT_EQ(split_k_for(17, 56, 132), 4);
  EXPECT_EQ(split_k_for(56, 128, 132), 2);
  EXPECT_EQ(split_k_for(8 * 32, 56, 132), 1);
  EXPECT_EQ(split_k_for(0, 56, 132), 1);
}

// dense_split_for's choices on DeepSeek-V3's dense shapes (host
// arithmetic: runs without a GPU) for 132 SMs: qkv_a (N 2176: 17 tiles a
// row tile, 56 k-blocks) whole up to 64 rows, in 4 slices at 65-128, 3 at
// 129-256 (one wave of 102 CTAs), 2 at 257-384, whole from 385 (68 tiles:
// more than half the SMs); o_proj (N 7168, 128 k-blocks: 56 tiles) in 2
// at 128 rows, whole at 256 (112 tiles); a K of 7 k-blocks never (slices
// of at least 4); no rows, no split.
TEST(ExpertsDenseStreamK, SliceCountsForDeepSeekShapes) {
  using moelink::detail::experts::dense_split_for;
  EXPECT_EQ(dense_split_for(1, 2176, 7168, 132), 1);
  EXPECT_EQ(dense_split_for(64, 2176, 7168, 132), 1);
  EXPECT_EQ(dense_split_for(65, 2176, 7168, 132), 4);
  EXPECT_EQ(dense_split_for(128, 2176, 7168, 132), 4);
  EXPECT_EQ(dense_split_for(256, 2176, 7168, 132), 3);
  EXPECT_EQ(dense_split_for(257, 2176, 7168, 132), 2);
  EXPECT_EQ(dense_split_for(512, 2176, 7168, 132), 1);
  EXPECT_EQ(dense_split_for(128, 7168, 16384, 132), 2);
  EXPECT_EQ(dense_split_for(256, 7168, 16384, 132), 1);
  EXPECT_EQ(dense_split_for(128, 2176, 896, 132), 1);
  EXPECT_EQ(dense_split_for(0, 2176, 7168, 132), 1);
}

// One object through calls with few, many and no tiles in turn: the
// swapped-operand tiles (16 rows expected) on 16 experts x 32 tiles and on
// DeepSeek-V3's shape, then groups of 300 rows on the 64-row tiles, the
// 128-row tiles (in the dynamic order) and the 128-row tiles in clusters.
TEST(GpuExpertsReuse, CallAfterCallMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  run_grouped_gemm_reuse_case(ExpertDevice::kCUDA, ops, {"ManyTiles", 16, 32, 4096, 256}, 16);
  run_grouped_gemm_reuse_case(ExpertDevice::kCUDA, ops, deepseek_shape(), 16);
  run_grouped_gemm_reuse_case(ExpertDevice::kCUDA, ops, {"Rows300", 3, 300, 512, 256}, 48);
  run_grouped_gemm_reuse_case(ExpertDevice::kCUDA, ops, {"Rows300", 3, 300, 512, 256}, 128);
  run_grouped_gemm_reuse_case(ExpertDevice::kCUDA, ops, {"Rows300", 3, 300, 512, 256}, 300);
}

// The launch settings other than the defaults (PDL, balanced GEMM grids,
// dynamic tile order, tiles numbered along N for many row tiles, forward()'s
// GEMM arguments in one launch; the cases above): kernels in plain stream
// order, one GEMM block per SM, CUTLASS's static tile order and its
// numbering down M, an argument kernel before each GEMM; and the errors for
// values they do not take.
TEST(GpuExpertsLaunch, PlainOrderAndFullGridsMatchReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  const char* settings[][4] = {{"0", "balanced", "1", "1"}, {"1", "all", "1", "2"}, {"0", "all", "1", "2"},
                                {"1", "balanced", "0", "1"}, {"1", "balanced", "1", "2"}};
  for (const auto& s : settings) {
    SCOPED_TRACE(std::string("MOELINK_EXPERTS_PDL=") + s[0] + " MOELINK_EXPERTS_GEMM_CTAS=" + s[1] +
                 " MOELINK_EXPERTS_DYNAMIC_TILES=" + s[2] + " MOELINK_EXPERTS_ARGUMENT_KERNELS=" + s[3]);
    setenv("MOELINK_EXPERTS_PDL", s[0], 1);
    setenv("MOELINK_EXPERTS_GEMM_CTAS", s[1], 1);
    setenv("MOELINK_EXPERTS_DYNAMIC_TILES", s[2], 1);
    setenv("MOELINK_EXPERTS_ARGUMENT_KERNELS", s[3], 1);
    run_forward_case(ExpertDevice::kCUDA, ops, {deepseek_shape(), CountPattern::kTop8, 16});
    run_forward_case(ExpertDevice::kCUDA, ops, {{"Rows300", 2, 300, 512, 256}, CountPattern::kRandom, 300});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {small_shape(), CountPattern::kSkewed, 48});
    run_grouped_gemm_case(ExpertDevice::kCUDA, ops, {{"Rows300", 3, 300, 512, 256}, CountPattern::kRandom, 128});
    run_gemm_case(ExpertDevice::kCUDA, ops, 2, 2 * 2048, 7168, 1);  // split over K
    run_quantize_case(ExpertDevice::kCUDA, ops, 37, 7168, 20);
    run_out_of_range_case(ExpertDevice::kCUDA, ops);
  }
  unsetenv("MOELINK_EXPERTS_PDL");
  unsetenv("MOELINK_EXPERTS_GEMM_CTAS");
  unsetenv("MOELINK_EXPERTS_DYNAMIC_TILES");
  unsetenv("MOELINK_EXPERTS_ARGUMENT_KERNELS");
  // CUTLASS's tile order (down M) where there are many row tiles.
  setenv("MOELINK_EXPERTS_RASTER", "m", 1);
  run_gemm_case(ExpertDevice::kCUDA, ops, 20000, 384, 256, 19950);
  unsetenv("MOELINK_EXPERTS_RASTER");
  for (const auto& [var, bad] : {std::pair{"MOELINK_EXPERTS_PDL", "yes"}, {"MOELINK_EXPERTS_GEMM_CTAS", "7"},
                                 {"MOELINK_EXPERTS_DYNAMIC_TILES", "on"}, {"MOELINK_EXPERTS_RASTER", "n"},
                                 {"MOELINK_EXPERTS_ARGUMENT_KERNELS", "3"}})
    expect_setting_rejected(var, bad, "");
}

TEST(GpuExpertsDense, QuantizeMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  run_quantize_case(ExpertDevice::kCUDA, ops, 37, 7168, -1);
  run_quantize_case(ExpertDevice::kCUDA, ops, 16, 256, 5);
  run_quantize_case(ExpertDevice::kCUDA, ops, 9, 384, 0);
  run_quantize_case(ExpertDevice::kCUDA, ops, 1, 128, 1);
  run_quantize_case(ExpertDevice::kCUDA, ops, 4099, 1024, 3001);
}

TEST(GpuExpertsDense, GemmMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  run_gemm_case(ExpertDevice::kCUDA, ops, 5, 256, 384, -1);
  run_gemm_case(ExpertDevice::kCUDA, ops, 33, 384, 256, 17);
  run_gemm_case(ExpertDevice::kCUDA, ops, 4, 128, 128, 0);
  run_gemm_case(ExpertDevice::kCUDA, ops, 100, 512, 1024, 70);                // 128-row tiles
  run_gemm_case(ExpertDevice::kCUDA, ops, 200, 512, 1024, 150);               // in clusters of 2
  run_gemm_case(ExpertDevice::kCUDA, ops, 600, 384, 512, -1);                 // 5 row tiles: a half cluster
  run_gemm_case(ExpertDevice::kCUDA, ops, 2, 2 * 2048, 7168, 1);  // DeepSeek-V3's shared expert, m = 1
  // DeepSeek-V3's merged qkv_a (17 weight tiles, 56 k-blocks): split over K
  // on the swapped-operand tiles at 1 row, whole on the 128-row tiles at
  // 128 and 256 rows, with a bound inside the last row tile.
  run_gemm_case(ExpertDevice::kCUDA, ops, 1, 2176, 7168, -1);
  run_gemm_case(ExpertDevice::kCUDA, ops, 128, 2176, 7168, 77);
  run_gemm_case(ExpertDevice::kCUDA, ops, 256, 2176, 7168, 250);
  // 157 row tiles, more than half an H200's 132 SMs: numbered along N in
  // stripes of 8 row tiles (the last stripe partial), and a bound inside
  // the last.
  run_gemm_case(ExpertDevice::kCUDA, ops, 20000, 384, 256, -1);
  run_gemm_case(ExpertDevice::kCUDA, ops, 20000, 384, 256, 19950);
}

// Issue 32 item 4: the decode tile (expected_rows 16) against the larger
// ones on the same one-row-per-expert inputs (H 1024, I 512), many seeds.
TEST(GpuExpertsPrecision, DecodeTileMatchesTheOthersOverSeeds) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  run_forward_precision_sweep(ops, {"Decode", 4, 16, 1024, 512}, {16, 48, 128, 256}, 64);
}

TEST(GpuExpertsErrors, CountsOutOfRangeAreClampedAndReported) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  run_out_of_range_case(ExpertDevice::kCUDA, ops);
}

// gemm() on two rows (the dense stream-K kernel off) splits over K into
// buffers it grows on the first call of a larger shape (16 rows). A graph
// captured at two rows keeps the buffers of then: replayed after the
// larger call, it must give the eager call's bits, and (under
// compute-sanitizer's memcheck, tools/gpu_check.sh sanitize) write no
// freed memory. The model's decode graphs hit this: one
// request's graph replayed after a step of 128 wrote freed memory.
TEST(GpuExpertsGraph, GemmReplaysAfterALargerCallGrewItsBuffers) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t N = 2 * 2048, K = 7168, kb = K / kGroup, nb = N / kGroup, small = 2, large = 16;
  moelink::ExpertConfig cfg;
  cfg.num_experts = 1, cfg.max_rows = 1, cfg.hidden_dim = 128, cfg.intermediate_dim = 128;
  cfg.device = ExpertDevice::kCUDA;
  cfg.debug = 0;
  setenv("MOELINK_EXPERTS_STREAM_K", "off", 1);  // the split over K with growing buffers
  auto ex = moelink::Experts::create(cfg);
  unsetenv("MOELINK_EXPERTS_STREAM_K");
  std::vector<uint8_t> w(N * K), x(large * K);
  std::vector<float> ws(nb * kb), xs(large * kb);
  random_block_weight(rng, N, K, w.data(), ws.data());
  random_fp8_rows(rng, large, K, x.data(), xs.data());
  void *dw = ops.alloc(w.size()), *dws = ops.alloc(ws.size() * 4), *dx = ops.alloc(x.size()),
       *dxs = ops.alloc(xs.size() * 4), *dy = ops.alloc(large * N * 2);
  ops.h2d(dw, w.data(), w.size());
  ops.h2d(dws, ws.data(), ws.size() * 4);
  ops.h2d(dx, x.data(), x.size());
  ops.h2d(dxs, xs.data(), xs.size() * 4);
  auto call = [&](int64_t M) {
    ex->gemm(Tensor::contiguous(dy, DType::kBFloat16, {M, N}), Tensor::contiguous(dx, DType::kFloat8E4M3, {M, K}),
             Tensor::contiguous(dxs, DType::kFloat32, {M, kb}), Tensor::contiguous(dw, DType::kFloat8E4M3, {N, K}),
             Tensor::contiguous(dws, DType::kFloat32, {nb, kb}), Tensor{}, ops.stream());
  };
  auto output = [&](int64_t M) {
    ops.sync();
    ex->check(ops.stream());
    std::vector<uint16_t> y(M * N);
    ops.d2h(y.data(), dy, y.size() * 2);
    return y;
  };
  call(small);  // the first call of the shape allocates (not allowed inside a capture)
  const std::vector<uint16_t> eager = output(small);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(ops.stream(), cudaStreamCaptureModeThreadLocal));
  call(small);
  CUDA_OK(cudaStreamEndCapture(ops.stream(), &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  call(large);  // grows the split buffers
  output(large);
  // Memory the old buffers' addresses may now belong to (allocations of
  // their sizes: scales 448 B and 7 KiB, partial sums 32 KiB a slice),
  // busy with other data.
  std::vector<std::pair<void*, size_t>> others;
  for (size_t bytes : {size_t{448}, size_t{7168}, size_t{65536}, size_t{131072}, size_t{262144}})
    for (int i = 0; i < 4; ++i) {
      others.emplace_back(ops.alloc(bytes), bytes);
      ops.fill(others.back().first, 0x5A, bytes);
    }
  ops.fill(dy, 0x7F, large * N * 2);
  CUDA_OK(cudaGraphLaunch(exec, ops.stream()));
  const std::vector<uint16_t> replayed = output(small);
  EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), eager.size() * 2), 0)
      << "the graph captured at " << small << " rows, replayed after a call of " << large
      << ", differs from the eager call";
  for (const auto& [p, bytes] : others) {
    std::vector<uint8_t> back(bytes);
    ops.d2h(back.data(), p, bytes);
    EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0x5A; }))
        << "the replay wrote into memory allocated after the larger call (" << bytes << " bytes)";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
}

// The dense GEMM called without a bound, split over K inside one kernel
// (dense_stream_k_gemm.h): DeepSeek-V3's merged qkv_a (17 weight tiles, 56
// k-blocks) at 1, 7, 128 (one row tile) and 200 rows (two), a GEMM of 56
// tiles (o_proj's N) and one of 2 tiles and 5 k-blocks (split only when
// forced: slices of one k-block, more slices asked than blocks), under
// auto, CUTLASS's stream-K decomposition and forced counts (3 leaves
// uneven slices: 56 = 18 + 19 + 19). y starts poisoned, so every row must
// be written; with a bound the tiled kernels run and rows past it stay.
TEST(GpuExpertsDenseStreamK, EveryScheduleMatchesReference) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  for (const char* v : {"auto", "streamk", "2", "3", "8", "16"}) {
    SCOPED_TRACE(std::string("MOELINK_EXPERTS_STREAM_K=") + v);
    setenv("MOELINK_EXPERTS_STREAM_K", v, 1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 1, 2176, 7168, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 7, 2176, 7168, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 128, 2176, 7168, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 200, 2176, 7168, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 3, 7168, 2048, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 9, 256, 640, -1);
    run_gemm_case(ExpertDevice::kCUDA, ops, 9, 256, 640, 4);
  }
  for (const char* bad : {"1", "17", "on", "2x"})
    expect_setting_rejected("MOELINK_EXPERTS_STREAM_K", bad, " must be auto, off, streamk or a split count 2 to 16");
}

// Each launch of the stream-K kernel must leave its workspace's locks zero
// (LockResettingStreamK): a lock left counting makes the next launch of
// that layout wait forever or add its slices out of order. Three layouts
// (qkv_a at 1 and 200 rows: one and two row tiles; 8 tiles of 1024
// columns) alternate, twice eagerly, then captured in one graph replayed
// three times; every output equals the first eager one bit for bit (the
// slices are added in a fixed order). A hang ends the test after 20 s.
TEST(GpuExpertsDenseStreamK, LaunchesLeaveTheLocksZero) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t K = 7168, kb = K / kGroup, rows = 200;
  moelink::ExpertConfig cfg;
  cfg.num_experts = 1, cfg.max_rows = 1, cfg.hidden_dim = 128, cfg.intermediate_dim = 128;
  cfg.device = ExpertDevice::kCUDA;
  auto ex = moelink::Experts::create(cfg);
  std::vector<uint8_t> x(rows * K);
  std::vector<float> xs(rows * kb);
  random_fp8_rows(rng, rows, K, x.data(), xs.data());
  void *dx = ops.alloc(x.size()), *dxs = ops.alloc(xs.size() * 4);
  ops.h2d(dx, x.data(), x.size());
  ops.h2d(dxs, xs.data(), xs.size() * 4);
  struct Call {
    int64_t m, n;
    void *w, *ws, *y;
  };
  std::vector<Call> calls = {{1, 2176, nullptr, nullptr, nullptr}, {200, 2176, nullptr, nullptr, nullptr},
                             {64, 1024, nullptr, nullptr, nullptr}};
  for (Call& c : calls) {
    std::vector<uint8_t> w(c.n * K);
    std::vector<float> ws(c.n / kGroup * kb);
    random_block_weight(rng, c.n, K, w.data(), ws.data());
    c.w = ops.alloc(w.size()), c.ws = ops.alloc(ws.size() * 4), c.y = ops.alloc(c.m * c.n * 2);
    ops.h2d(c.w, w.data(), w.size());
    ops.h2d(c.ws, ws.data(), ws.size() * 4);
  }
  auto launch_all = [&] {
    for (const Call& c : calls)
      ex->gemm(Tensor::contiguous(c.y, DType::kBFloat16, {c.m, c.n}),
               Tensor::contiguous(dx, DType::kFloat8E4M3, {c.m, K}),
               Tensor::contiguous(dxs, DType::kFloat32, {c.m, kb}),
               Tensor::contiguous(c.w, DType::kFloat8E4M3, {c.n, K}),
               Tensor::contiguous(c.ws, DType::kFloat32, {c.n / kGroup, kb}), Tensor{}, ops.stream());
  };
  auto outputs = [&](const char* when) {
    const auto start = std::chrono::steady_clock::now();
    cudaError_t e;
    while ((e = cudaStreamQuery(ops.stream())) == cudaErrorNotReady)
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(20)) {
        ADD_FAILURE() << when << ": the GEMMs did not finish in 20 s (a lock not reset?)";
        std::fflush(nullptr);
        std::_Exit(3);  // the GPU is stuck: nothing after this can run
      }
    CUDA_OK(e);
    ex->check(ops.stream());
    std::vector<std::vector<uint16_t>> ys;
    for (const Call& c : calls) {
      ys.emplace_back(c.m * c.n);
      ops.d2h(ys.back().data(), c.y, ys.back().size() * 2);
      ops.fill(c.y, 0x7F, c.m * c.n * 2);
    }
    return ys;
  };
  launch_all();
  const auto first = outputs("first calls");
  launch_all();
  launch_all();
  EXPECT_EQ(outputs("eager calls twice over"), first) << "a second eager round differs from the first";
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(ops.stream(), cudaStreamCaptureModeThreadLocal));
  launch_all();
  launch_all();
  CUDA_OK(cudaStreamEndCapture(ops.stream(), &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    CUDA_OK(cudaGraphLaunch(exec, ops.stream()));
    EXPECT_EQ(outputs("graph replay"), first) << "replay " << replay << " differs from the eager calls";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
}

// forward() captured once in a CUDA graph, replayed with new counts and new
// activations written into the same buffers: each replay must give the bits
// an eager forward() gives on the same inputs (checked elementwise by the
// cases above), write no row past a count, and stay within the fp64
// reference's relative L2 bound.
TEST(GpuExpertsGraph, ForwardReplaysWithNewCounts) {
  REQUIRE_HOPPER();
  GpuMemoryOps ops(0);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int L = 4;
  const int64_t C = 64, H = 512, I = 256, hb = H / kGroup, ib = I / kGroup;
  moelink::ExpertConfig cfg;
  cfg.num_experts = L, cfg.max_rows = C, cfg.hidden_dim = H, cfg.intermediate_dim = I;
  cfg.device = ExpertDevice::kCUDA;
  cfg.debug = 0;
  auto ex = moelink::Experts::create(cfg);

  std::vector<uint8_t> w13(L * 2 * I * H), w2(L * H * I), x(L * C * H);
  std::vector<float> w13s(L * (2 * I / kGroup) * hb), w2s(L * hb * ib), xs(L * C * hb);
  for (int l = 0; l < L; ++l) {
    random_block_weight(rng, 2 * I, H, &w13[l * 2 * I * H], &w13s[l * (2 * I / kGroup) * hb]);
    random_block_weight(rng, H, I, &w2[l * H * I], &w2s[l * hb * ib]);
  }
  auto dev = [&](size_t bytes) { return ops.alloc(bytes); };
  void *dw13 = dev(w13.size()), *dw13s = dev(w13s.size() * 4), *dw2 = dev(w2.size()),
       *dw2s = dev(w2s.size() * 4), *dx = dev(x.size()), *dxs = dev(xs.size() * 4),
       *dcount = dev(L * 4), *dy = dev(L * C * H * 2);
  ops.h2d(dw13, w13.data(), w13.size());
  ops.h2d(dw13s, w13s.data(), w13s.size() * 4);
  ops.h2d(dw2, w2.data(), w2.size());
  ops.h2d(dw2s, w2s.data(), w2s.size() * 4);
  int64_t call_rows = 0;
  auto call = [&] {
    ex->forward(Tensor::contiguous(dy, DType::kBFloat16, {L, C, H}),
                Tensor::contiguous(dcount, DType::kInt32, {L}),
                Tensor::contiguous(dx, DType::kFloat8E4M3, {L, C, H}),
                Tensor::contiguous(dxs, DType::kFloat32, {L, C, hb}),
                Tensor::contiguous(dw13, DType::kFloat8E4M3, {L, 2 * I, H}),
                Tensor::contiguous(dw13s, DType::kFloat32, {L, 2 * I / kGroup, hb}),
                Tensor::contiguous(dw2, DType::kFloat8E4M3, {L, H, I}),
                Tensor::contiguous(dw2s, DType::kFloat32, {L, hb, ib}), ops.stream(), call_rows);
  };
  // The config's tiles (64 rows) and the row classes a call may name below
  // them (their GEMM objects made by create(): the capture allocates nothing).
  for (int64_t rows : {0, 1, 16, 40}) {
    SCOPED_TRACE("expected_rows " + std::to_string(rows));
    call_rows = rows;
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(ops.stream(), cudaStreamCaptureModeThreadLocal));
    call();
    CUDA_OK(cudaStreamEndCapture(ops.stream(), &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    for (CountPattern p : {CountPattern::kRandom, CountPattern::kOne, CountPattern::kSkewed,
                           CountPattern::kZero, CountPattern::kTop8, CountPattern::kFull}) {
      SCOPED_TRACE(count_pattern_name(p));
      const std::vector<int32_t> counts = make_counts(p, L, C, rng);
      random_fp8_rows(rng, L * C, H, x.data(), xs.data());
      ops.h2d(dcount, counts.data(), L * 4);
      ops.h2d(dx, x.data(), x.size());
      ops.h2d(dxs, xs.data(), xs.size() * 4);
      ops.fill(dy, 0x7F, L * C * H * 2);
      CUDA_OK(cudaGraphLaunch(exec, ops.stream()));
      ops.sync();
      ex->check(ops.stream());
      std::vector<uint16_t> y(L * C * H), y_eager(L * C * H);
      ops.d2h(y.data(), dy, y.size() * 2);
      ops.fill(dy, 0x7F, L * C * H * 2);
      call();
      ex->check(ops.stream());
      ops.d2h(y_eager.data(), dy, y_eager.size() * 2);
      double err2 = 0, ref2 = 0;
      std::vector<double> v(I);
      std::vector<uint8_t> aq(I);
      std::vector<float> as(ib);
      for (int l = 0; l < L; ++l) {
        for (int64_t r = 0; r < C; ++r) {
          const uint16_t* row = &y[(l * C + r) * H];
          ASSERT_EQ(std::memcmp(row, &y_eager[(l * C + r) * H], H * 2), 0)
              << "expert " << l << " row " << r << ": the replay differs from an eager forward()";
          if (r >= counts[l]) {
            ASSERT_EQ(row[0], 0x7F7F) << "expert " << l << " row " << r << " past the count written";
            continue;
          }
          const int64_t at = l * C + r;
          const RefRow gu = ref_gemm_row(&x[at * H], &xs[at * hb], &w13[l * 2 * I * H],
                                         &w13s[l * (2 * I / kGroup) * hb], 2 * I, H);
          for (int64_t i = 0; i < I; ++i) v[i] = ref_silu_mul(round_to_bf16(gu.y[i]), round_to_bf16(gu.y[I + i]));
          ref_quantize_row(v.data(), I, aq.data(), as.data());
          const RefRow ref = ref_gemm_row(aq.data(), as.data(), &w2[l * H * I], &w2s[l * hb * ib], H, I);
          for (int64_t n = 0; n < H; ++n) {
            const double d = bf16_to_double(row[n]) - ref.y[n];
            err2 += d * d;
            ref2 += ref.y[n] * ref.y[n];
          }
        }
      }
      if (ref2 > 0) {
        EXPECT_LT(std::sqrt(err2 / ref2), 5e-2);
      }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  for (void* p : {dw13, dw13s, dw2, dw2s, dx, dxs, dcount, dy}) ops.free(p);
}

}  // namespace
}  // namespace moelink_test
