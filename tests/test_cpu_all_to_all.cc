// Dispatch/combine on the CPU backend (POSIX shared memory between forked
// ranks), checked against tests/reference.h by the shared driver
// (tests/all_to_all_cases.h): shapes, dtypes, DP groups, routing kinds,
// split calls, accumulation, bad input and a rank that leaves.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "all_to_all_cases.h"
#include "case_builders.h"
#include "rank_harness.h"
#include "ref_dtype.h"
#include "reference.h"

namespace moelink_test {
namespace {

using moelink::DType;

constexpr int kCaseTimeoutS = 240;

void run_cpu_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    auto ops = make_host_memory_ops();
    run_case_on_rank(spec, rank, bs, *ops);
  }, kCaseTimeoutS);
}

// A spec with the CPU backend and the given shape; the rest default.
CaseSpec cpu(int W, int dp, int64_t T, int E, int k, int64_t H, DType in, DType out, DType y) {
  return make_spec(moelink::Backend::kCPU, W, dp, T, E, k, H, in, out, y);
}

// ------------------------------------------------------------ shapes and dtypes

class CpuAllToAll : public testing::TestWithParam<NamedCase> {};

TEST_P(CpuAllToAll, DispatchAndCombineMatchReference) { run_cpu_case(GetParam().spec); }

std::vector<NamedCase> shape_cases() {
  std::vector<NamedCase> v;
  v.push_back({"W1_Bf16_K2_E8", cpu(1, 1, 32, 8, 2, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Bf16_K1_E8", cpu(2, 1, 32, 8, 1, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Fp8_K8_E64_OutFp16_YFp32",
               with(cpu(2, 1, 32, 64, 8, 1024, kFp8, kFp16, kFp32),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W4_Fp16_K4_E16_YFp32_Int32",
               with(cpu(4, 1, 24, 16, 4, 512, kFp16, kFp16, kFp32),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W4_Dp2_Fp8_K8_E32_Uint32",
               with(cpu(4, 2, 32, 32, 8, 512, kFp8, kFp16, kBf16),
                    [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"W2_Dp2_Bf16_K8_E8_YFp16", cpu(2, 2, 16, 8, 8, 256, kBf16, kBf16, kFp16)});
  v.push_back({"W4_Dp4_Fp16_K3_E12", cpu(4, 4, 20, 12, 3, 128, kFp16, kBf16, kBf16)});
  v.push_back({"W2_Fp8_OneScale_K2_E8",
               with(cpu(2, 1, 16, 8, 2, 256, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.hidden_dim_scale = 1; })});
  v.push_back({"W1_Fp16_K8_E384_H2048_YFp32", cpu(1, 1, 16, 384, 8, 2048, kFp16, kFp16, kFp32)});
  v.push_back({"W4_Bf16_K8_E384", cpu(4, 1, 16, 384, 8, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Fp8_K8_E16_H7168_S56", cpu(2, 1, 16, 16, 8, 7168, kFp8, kBf16, kBf16)});
  v.push_back({"W4_Dp2_Bf16_K2_E8_H4096", cpu(4, 2, 16, 8, 2, 4096, kBf16, kFp16, kBf16)});
  v.push_back({"W2_DeepSeekLike_Fp8_H7168_E256_K8",
               with(cpu(2, 1, 16, 256, 8, 7168, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.rounds = 3; })});
  v.push_back({"W2_T64_Bf16_K2_E8", cpu(2, 1, 64, 8, 2, 128, kBf16, kBf16, kBf16)});
  v.push_back({"W1_T1_Bf16_K1_E1", cpu(1, 1, 1, 1, 1, 16, kBf16, kBf16, kBf16)});
  v.push_back({"W3_Fp16_K2_E6", cpu(3, 1, 16, 6, 2, 64, kFp16, kFp16, kFp16)});
  for (uint64_t seed : {2, 3, 4})
    v.push_back({"W4_Dp2_Bf16_Seed" + std::to_string(seed),
                 with(cpu(4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16),
                      [&](CaseSpec& s) { s.seed = seed; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuAllToAll, testing::ValuesIn(shape_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

// ------------------------------------------------------------ routing x index dtype

std::vector<NamedCase> routing_cases() {
  std::vector<NamedCase> v;
  const std::pair<Routing, const char*> routings[] = {{Routing::kUniform, "Uniform"},
                                                      {Routing::kSkewed, "Skewed"},
                                                      {Routing::kWithNone, "WithNone"},
                                                      {Routing::kRepeated, "Repeated"}};
  const std::pair<DType, const char*> indices[] = {
      {DType::kInt32, "Int32"}, {DType::kUInt32, "Uint32"}, {DType::kInt64, "Int64"}};
  int i = 0;
  for (const auto& [routing, rname] : routings)
    for (const auto& [idx, iname] : indices) {
      // Alternate the layout so each routing meets DP groups and plain ranks.
      const bool dp = (i++ % 2) == 0;
      CaseSpec s = dp ? cpu(4, 2, 32, 16, 4, 128, kFp8, kBf16, kBf16)
                      : cpu(2, 1, 32, 8, 3, 128, kBf16, kFp16, kFp16);
      s.routing = routing;
      s.index_dtype = idx;
      s.seed = 10 + i;
      v.push_back({std::string(rname) + "_" + iname + (dp ? "_W4Dp2" : "_W2"), s});
    }
  // All tokens to one expert with full groups: the expert gets up to C rows.
  v.push_back({"Skewed_K1_AllTokensOneExpert",
               with(cpu(4, 1, 16, 8, 1, 128, kBf16, kBf16, kBf16),
                    [](CaseSpec& s) { s.routing = Routing::kSkewed; })});
  // Repeated experts with k == E: experts fill up to their capacity.
  v.push_back({"Repeated_K8_E8_CapacityEdge",
               with(cpu(2, 1, 16, 8, 8, 128, kBf16, kBf16, kBf16),
                    [](CaseSpec& s) { s.routing = Routing::kRepeated; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Routing, CpuAllToAll, testing::ValuesIn(routing_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

// ------------------------------------------------------------ call modes

std::vector<NamedCase> mode_cases() {
  std::vector<NamedCase> v;
  v.push_back({"Split_W2", with(cpu(2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16),
                                [](CaseSpec& s) { s.split = true; })});
  v.push_back({"Split_W4_Dp2_Fp8", with(cpu(4, 2, 32, 16, 4, 256, kFp8, kFp16, kBf16),
                                        [](CaseSpec& s) { s.split = true; })});
  v.push_back({"Accumulate_W2_Bf16", with(cpu(2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16),
                                          [](CaseSpec& s) { s.accumulate = true; })});
  v.push_back({"Accumulate_W4_Dp2_Fp16_Split",
               with(cpu(4, 2, 32, 16, 4, 256, kFp16, kFp16, kFp32), [](CaseSpec& s) {
                 s.accumulate = true;
                 s.split = true;
               })});
  v.push_back({"Strided_W2_Fp8_ColumnMajorScales",
               with(cpu(2, 1, 32, 16, 4, 512, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.strided = true; })});
  v.push_back({"Strided_W4_Dp2_Bf16_Uint32", with(cpu(4, 2, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                                 [](CaseSpec& s) {
                                                   s.strided = true;
                                                   s.index_dtype = DType::kUInt32;
                                                   s.routing = Routing::kWithNone;
                                                 })});
  v.push_back({"Padded_W2_Fp8", with(cpu(2, 1, 32, 16, 4, 256, kFp8, kBf16, kFp32),
                                     [](CaseSpec& s) { s.padded = true; })});
  v.push_back({"Padded_Strided_W4_Dp2_Bf16_Accumulate_Split",
               with(cpu(4, 2, 16, 8, 2, 128, kBf16, kFp16, kBf16), [](CaseSpec& s) {
                 s.padded = true;
                 s.strided = true;
                 s.accumulate = true;
                 s.split = true;
                 s.input_rows = 12;
               })});
  v.push_back({"InputRowsFewerThanT_W2", with(cpu(2, 1, 32, 8, 2, 128, kBf16, kBf16, kBf16),
                                              [](CaseSpec& s) { s.input_rows = 20; })});
  v.push_back({"InputRowsFewerThanT_W4Dp2_Strided",
               with(cpu(4, 2, 32, 8, 2, 128, kFp8, kFp16, kBf16), [](CaseSpec& s) {
                 s.input_rows = 13;
                 s.strided = true;
               })});
  v.push_back({"ManyRounds_W2", with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                     [](CaseSpec& s) { s.rounds = 12; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuAllToAll, testing::ValuesIn(mode_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

// ------------------------------------------------------------ bad input

// Round 1 carries the bad input: check() throws InputError on the rank that
// read it (naming rank, field and value), the bad route / m is dropped /
// clamped, nothing is written out of bounds, and round 2 is clean again.
std::vector<NamedCase> input_error_cases() {
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_Int64_W2",
               with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                    [](CaseSpec& s) { s.inject = Inject::kExpertIdE; })});
  v.push_back({"ExpertIdMinus5_Int64_W2",
               with(cpu(2, 1, 16, 8, 2, 128, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.inject = Inject::kExpertIdMinus5; })});
  v.push_back({"ExpertIdMinus5_Int32_W4Dp2",
               with(cpu(4, 2, 16, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kInt32;
               })});
  v.push_back({"ExpertIdMinus5_Uint32_W2",
               with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kUInt32;
               })});
  v.push_back({"BoundMTooLarge_W2", with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMTooLarge; })});
  v.push_back({"BoundMTooLarge_W4Dp2",
               with(cpu(4, 2, 16, 8, 2, 128, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.inject = Inject::kBoundMTooLarge; })});
  v.push_back({"BoundMPastInputRows_W2",
               with(cpu(2, 1, 32, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.input_rows = 20;
                 s.inject = Inject::kBoundMTooLarge;
               })});
  v.push_back({"ExpertOverflow_W2_K2", with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                            [](CaseSpec& s) { s.inject = Inject::kExpertOverflow; })});
  v.push_back({"ExpertOverflow_W4Dp2_K4_Fp8",
               with(cpu(4, 2, 16, 8, 4, 256, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.inject = Inject::kExpertOverflow; })});
  v.push_back({"BoundMNegative_W2", with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMNegative; })});
  return v;
}

class CpuAllToAllInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(CpuAllToAllInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  run_cpu_case(GetParam().spec);
}

INSTANTIATE_TEST_SUITE_P(BadInput, CpuAllToAllInputError, testing::ValuesIn(input_error_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

// ------------------------------------------------------------ a rank leaves

void run_rank_exit(const CaseSpec& spec, int exiting_rank, bool before_combine = false) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    auto ops = make_host_memory_ops();
    run_rank_exit_case(spec, rank, exiting_rank, bs, *ops, before_combine);
  }, 120);
}

TEST(CpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW2) {
  run_rank_exit(with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                     [](CaseSpec& s) { s.timeout_s = 2; }),
                1);
}

TEST(CpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW4Dp2) {
  run_rank_exit(with(cpu(4, 2, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                     [](CaseSpec& s) { s.timeout_s = 2; }),
                3);
}

TEST(CpuAllToAllTimeout, RankZeroThatExitsIsNamedInTimeoutError) {
  run_rank_exit(with(cpu(3, 1, 16, 12, 2, 128, kFp16, kFp16, kFp16),
                     [](CaseSpec& s) { s.timeout_s = 2; }),
                0);
}

TEST(CpuAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutError) {
  run_rank_exit(with(cpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                     [](CaseSpec& s) { s.timeout_s = 2; }),
                1, /*before_combine=*/true);
}

TEST(CpuAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutErrorW4Dp2) {
  run_rank_exit(with(cpu(4, 2, 16, 8, 2, 128, kFp8, kBf16, kBf16),
                     [](CaseSpec& s) { s.timeout_s = 2; }),
                2, /*before_combine=*/true);
}

// ------------------------------------------------------------ the reference itself

TEST(ReferenceDtypes, Fp8E4M3DecodesKnownValues) {
  EXPECT_EQ(fp8_e4m3_to_double(0x00), 0.0);
  EXPECT_EQ(fp8_e4m3_to_double(0x38), 1.0);
  EXPECT_EQ(fp8_e4m3_to_double(0x40), 2.0);
  EXPECT_EQ(fp8_e4m3_to_double(0x3C), 1.5);
  EXPECT_EQ(fp8_e4m3_to_double(0x7E), 448.0);
  EXPECT_EQ(fp8_e4m3_to_double(0xFE), -448.0);
  EXPECT_EQ(fp8_e4m3_to_double(0x08), std::ldexp(1.0, -6));
  EXPECT_EQ(fp8_e4m3_to_double(0x01), std::ldexp(1.0, -9));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_double(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_double(0xFF)));
}

TEST(ReferenceDtypes, Fp16AndBf16RoundTripEveryBitPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const double f16 = fp16_to_double(h), bf = bf16_to_double(h);
    if (!std::isnan(f16)) {
      ASSERT_EQ(round_to_fp16(f16), f16) << std::hex << b;
      ASSERT_EQ(fp16_bits_exact(f16), h) << std::hex << b;
    }
    if (!std::isnan(bf)) {
      ASSERT_EQ(round_to_bf16(bf), bf) << std::hex << b;
      ASSERT_EQ(bf16_bits_exact(bf), h) << std::hex << b;
    }
  }
  EXPECT_EQ(fp16_to_double(0x3C00), 1.0);
  EXPECT_EQ(fp16_to_double(0x7BFF), 65504.0);
  EXPECT_EQ(fp16_to_double(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(bf16_to_double(0x3F80), 1.0);
}

TEST(ReferenceDtypes, RoundingIsToNearestTiesToEven) {
  EXPECT_EQ(round_to_fp16(1 + std::ldexp(1.0, -11)), 1.0);  // tie: down to even
  EXPECT_EQ(round_to_fp16(1 + 3 * std::ldexp(1.0, -11)), 1 + std::ldexp(1.0, -9));  // tie: up
  EXPECT_EQ(round_to_fp16(1 + 1.1 * std::ldexp(1.0, -11)), 1 + std::ldexp(1.0, -10));
  EXPECT_EQ(round_to_fp16(65519.0), 65504.0);
  EXPECT_TRUE(std::isinf(round_to_fp16(65520.0)));
  EXPECT_EQ(round_to_fp16(std::ldexp(1.0, -25)), 0.0);  // half the smallest subnormal: even
  EXPECT_EQ(round_to_fp16(std::ldexp(1.5, -25)), std::ldexp(1.0, -24));
  EXPECT_EQ(round_to_bf16(1 + std::ldexp(1.0, -8)), 1.0);
  EXPECT_EQ(round_to_bf16(1 + 3 * std::ldexp(1.0, -8)), 1 + std::ldexp(1.0, -6));
  EXPECT_EQ(round_to_bf16(-(1 + 3 * std::ldexp(1.0, -8))), -(1 + std::ldexp(1.0, -6)));
}

// Two ranks (L = 2 experts each), two DP groups, k = 3, T = 4, C = 8.
struct TinyRouting {
  moelink::Config c;
  std::vector<GroupInputs> groups;
  TinyRouting() {
    c.max_num_tokens = 4;
    c.num_experts = 4;
    c.experts_per_token = 3;
    c.hidden_dim = 16;
    c.in_dtype = DType::kBFloat16;
    c.out_dtype = DType::kBFloat16;
    c.world_size = 2;
    groups.resize(2);
    for (int g = 0; g < 2; ++g) {
      groups[g].x.resize(4 * 32);
      for (int t = 0; t < 4; ++t)  // distinct rows of ordinary values
        for (int h = 0; h < 16; ++h)
          encode_element(DType::kBFloat16, (g * 4 + t + 1) * (1 + h / 64.0),
                         groups[g].x.data() + t * 32, h);
      groups[g].weights.assign(12, 0.5f);
    }
    // Group 0, m = 2: expert 1 twice and no route; expert 3, a bad id, -5;
    // token 2 (>= m) would go to expert 0 but is not sent.
    groups[0].m = 2;
    groups[0].indices = {1, 1, -1, 3, 7, -5, 0, 0, 0, 0, 0, 0};
    groups[1].m = 1;
    groups[1].indices = {0, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  }
  // The correct dispatch result of `rank` (expected order, poison after).
  DispatchResult correct(const Reference& ref, int rank) const {
    DispatchResult d;
    d.counts.assign(2, 0);
    d.x.assign(2 * 8 * 32, kPoisonTokenByte);
    for (int j = 0; j < 2; ++j) {
      const auto& toks = ref.expected_tokens(rank, j);
      d.counts[j] = static_cast<int32_t>(toks.size());
      for (size_t i = 0; i < toks.size(); ++i)
        std::memcpy(d.x.data() + (j * 8 + i) * 32, groups[toks[i].group].x.data() + toks[i].token * 32,
                    32);
    }
    return d;
  }
};

TEST(Reference, ExpectedTokensCountRepeatsAndDropNoneBadIdsAndTokensPastM) {
  TinyRouting r;
  Reference ref(r.c, r.groups);
  using V = std::vector<TokenRef>;
  EXPECT_EQ(ref.expected_tokens(0, 0), (V{{1, 0}}));          // expert 0
  EXPECT_EQ(ref.expected_tokens(0, 1), (V{{0, 0}, {0, 0}}));  // expert 1, repeated
  EXPECT_EQ(ref.expected_tokens(1, 0), (V{{1, 0}}));          // expert 2
  EXPECT_EQ(ref.expected_tokens(1, 1), (V{{0, 1}, {1, 0}}));  // expert 3
}

TEST(Reference, DispatchCheckerAcceptsTheContractAndRejectsDeviations) {
  TinyRouting r;
  Reference ref(r.c, r.groups);
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_TRUE(ref.check_dispatch(rank, r.correct(ref, rank)).empty());
  DispatchResult d = r.correct(ref, 1);
  std::swap_ranges(d.x.begin() + 32, d.x.begin() + 64, d.x.begin() + 8 * 32 + 32);  // rows swapped
  EXPECT_FALSE(ref.check_dispatch(1, d).empty()) << "a token in the wrong expert";
  d = r.correct(ref, 1);
  d.counts[1] = 1;
  EXPECT_FALSE(ref.check_dispatch(1, d).empty()) << "a count one short";
  d = r.correct(ref, 0);
  d.x[(8 + 2) * 32 + 5] = 0;
  EXPECT_FALSE(ref.check_dispatch(0, d).empty()) << "a write to a row >= count";
  d = r.correct(ref, 0);
  std::memcpy(d.x.data() + (8 + 1) * 32, r.groups[0].x.data() + 2 * 32, 32);
  EXPECT_FALSE(ref.check_dispatch(0, d).empty()) << "token 2 of group 0 is past m";
}

TEST(Reference, CombineCheckerToleratesTwoUnitRoundoffsAndNoMore) {
  TinyRouting r;
  Reference ref(r.c, r.groups);
  const ExpertOutputFn y = [&](int e, int g, int64_t t) {
    return expert_function(r.c, DType::kBFloat16, false, e, r.groups[g].x.data() + t * 32, nullptr);
  };
  const std::vector<double> want = ref.expected_combine(0, y);
  std::vector<uint8_t> before(4 * 32, kPoisonOutByte), after = before;
  for (int64_t i = 0; i < 2 * 16; ++i) encode_element(DType::kBFloat16, want[i], after.data(), i);
  EXPECT_TRUE(ref.check_combine(0, y, before, after, false).empty());
  // Token 0 of group 0: two routes to expert 1, weight 0.5 each: |terms| sum = |want|.
  std::vector<uint8_t> off = after;
  encode_element(DType::kBFloat16, want[3] * (1 + 3 * std::ldexp(1.0, -8)), off.data(), 3);
  EXPECT_FALSE(ref.check_combine(0, y, before, off, false).empty()) << "3 roundoffs off";
  off = after;
  off[2 * 32 + 1] ^= 1;
  EXPECT_FALSE(ref.check_combine(0, y, before, off, false).empty()) << "row t >= m modified";
}

}  // namespace
}  // namespace moelink_test
