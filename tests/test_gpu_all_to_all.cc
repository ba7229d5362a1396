// Dispatch/combine on the NVLink backend, through the same driver and
// reference as the CPU tests. Plain C++ on the CUDA runtime API (no kernels
// here: the "other work" between split halves is a cudaMemsetAsync). Built
// only with MOELINK_WITH_CUDA; every test skips itself on a machine without a
// GPU. Rank r uses GPU r % gpu_count, so 4 ranks run on 2 GPUs as well. The
// cases and runners shared with the other GPU backends are in gpu_cases.h.
#include <gtest/gtest.h>

#include "gpu_cases.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

constexpr moelink::Backend kNVLink = moelink::Backend::kNVLink;

constexpr const char* kNoGpu =
    "no CUDA GPU on this machine: the NVLink tests run on the H200 device machine "
    "(tools/gpu_check.sh)";

#define REQUIRE_GPU()                                    \
  do {                                                   \
    if (probe_gpu_count() == 0) GTEST_SKIP() << kNoGpu;  \
  } while (0)

// ------------------------------------------------------------ eager cases

// Small cases, named GpuAllToAll.Small* for tools/gpu_check.sh's
// compute-sanitizer pass.
TEST(GpuAllToAll, SmallW2Bf16) {
  REQUIRE_GPU();
  run_gpu_case(small_w2_bf16_spec(kNVLink));
}

TEST(GpuAllToAll, SmallW2Dp2Fp8SplitAccumulate) {
  REQUIRE_GPU();
  run_gpu_case(small_w2_dp2_fp8_split_accumulate_spec(kNVLink));
}

TEST(GpuAllToAll, SmallW2StridedUint32WithNone) {
  REQUIRE_GPU();
  run_gpu_case(small_w2_strided_uint32_with_none_spec(kNVLink));
}

// Prefill-sized buffers (max_num_tokens * num_dp_groups >= 2048 rows per
// expert): the fused dispatch then overlaps its send and receive halves,
// publishing slots by their headers. m is random in [0, T], so slots past m
// and tokens without routes here must be recognised once their sender is done.
TEST(GpuAllToAll, PrefillOverlapW2Fp8) {
  REQUIRE_GPU();
  run_gpu_case(prefill_w2_fp8_spec(kNVLink));
}

TEST(GpuAllToAll, PrefillOverlapW4Dp2) {
  REQUIRE_GPU();
  run_gpu_case(prefill_w4_dp2_spec(kNVLink));
}

class GpuAllToAllCase : public testing::TestWithParam<NamedCase> {};

TEST_P(GpuAllToAllCase, DispatchAndCombineMatchReference) {
  REQUIRE_GPU();
  run_gpu_case(GetParam().spec);
}

INSTANTIATE_TEST_SUITE_P(NVLink, GpuAllToAllCase, testing::ValuesIn(gpu_eager_cases(kNVLink)),
                         CaseName());

// ------------------------------------------------------------ CUDA graphs

TEST(GpuAllToAll, SmallW2OneGraphReplays) {
  REQUIRE_GPU();
  run_one_graph_case(small_w2_one_graph_spec(kNVLink));
}

TEST(GpuAllToAllGraph, OneGraphReplaysWithFreshRoutingW2) {
  REQUIRE_GPU();
  run_one_graph_case(one_graph_fresh_routing_spec(kNVLink, 2));
}

TEST(GpuAllToAllGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2) {
  REQUIRE_GPU();
  run_one_graph_case(one_graph_split_other_work_w4_dp2_spec(kNVLink));
}

TEST(GpuAllToAllGraph, OneGraphDeepSeekShapeBf16W4) {
  REQUIRE_GPU();
  run_one_graph_case(one_graph_deepseek_bf16_spec(kNVLink, 4));
}

TEST(GpuAllToAllGraph, TwoGraphsDeepSeekFp8ReplaysW2) {
  REQUIRE_GPU();
  run_two_graph_case(deepseek_spec(kNVLink));
}

TEST(GpuAllToAllGraph, TwoGraphsSplitRepeatedW4Dp2) {
  REQUIRE_GPU();
  run_two_graph_case(two_graph_split_repeated_w4_dp2_spec(kNVLink));
}

// ------------------------------------------------------------ errors

class GpuAllToAllInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(GpuAllToAllInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_GPU();
  run_gpu_case(GetParam().spec);
}

INSTANTIATE_TEST_SUITE_P(NVLink, GpuAllToAllInputError,
                         testing::ValuesIn(gpu_input_error_cases(kNVLink)), CaseName());

TEST(GpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutError) {
  REQUIRE_GPU();
  run_gpu_rank_exit(rank_exit_spec(kNVLink, 2, 1), 1);
}

TEST(GpuAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutError) {
  REQUIRE_GPU();
  run_gpu_rank_exit(rank_exit_spec(kNVLink, 2, 1), 1, /*before_combine=*/true);
}

TEST(GpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW4Dp2) {
  REQUIRE_GPU();
  run_gpu_rank_exit(rank_exit_spec(kNVLink, 4, 2), 2);
}

}  // namespace
}  // namespace moelink_test
