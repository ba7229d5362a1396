// Dispatch/combine on the NVSHMEM backend, through the same driver and
// reference as the CPU and NVLink tests: the NVLink GPU case list (split
// halves, graph replays, skewed / empty / repeated routings, dp_size > 1,
// input errors, dead peers; shared in gpu_cases.h) plus one-rank cases and
// AllToAlls created one after another in one process (NVSHMEM is started
// once per process and its symmetric buffers are pooled).
//
// Rank r uses GPU r % gpu_count. Several ranks on one GPU are NVSHMEM
// "multiple PEs per GPU" (MPG): without MPS NVSHMEM runs it in a limited
// mode where its host-side collectives refuse to run, but P2P puts and
// signals between PEs of one device (all moelink uses) work. Set
// MOELINK_TEST_NVSHMEM_MPG=0 to skip every case that needs more ranks than
// GPUs. Every test skips itself, saying why, without a GPU or without
// NVSHMEM in the build.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "gpu_cases.h"
#include "gpu_memory_ops.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

constexpr moelink::Backend kNVSHMEM = moelink::Backend::kNVSHMEM;

bool mpg_allowed() {
  const char* v = std::getenv("MOELINK_TEST_NVSHMEM_MPG");
  return v == nullptr || std::string(v) != "0";
}

// Empty when a case with `world_size` ranks can run here, else why not.
std::string skip_reason(int world_size) {
#if !defined(MOELINK_TEST_NVSHMEM)
  (void)world_size;
  return "this build has no NVSHMEM (cmake/nvshmem.cmake did not find it; set NVSHMEM_HOME or "
         "pip install nvidia-nvshmem-cu13): backend \"nvshmem\" is a stand-in";
#else
  const int gpus = probe_gpu_count();
  if (gpus == 0)
    return "no CUDA GPU on this machine: the NVSHMEM tests run on the H200 device machine "
           "(tools/nvshmem_check.sh)";
  if (world_size > gpus && !mpg_allowed())
    return std::to_string(world_size) + " ranks on " + std::to_string(gpus) +
           " GPU(s) would put several NVSHMEM PEs on one GPU, and MOELINK_TEST_NVSHMEM_MPG=0";
  return "";
#endif
}

#define REQUIRE_NVSHMEM(world_size)                                 \
  do {                                                              \
    const std::string why_ = skip_reason(world_size);               \
    if (!why_.empty()) GTEST_SKIP() << why_;                        \
  } while (0)

// ------------------------------------------------------------ eager cases

// Small cases first: if NVSHMEM cannot start on this machine, these say so
// quickly. Named NvshmemAllToAll.Small* for a compute-sanitizer pass.
TEST(NvshmemAllToAll, SmallW1Bf16) {
  REQUIRE_NVSHMEM(1);
  run_gpu_case(make_spec(kNVSHMEM, 1, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16));
}

TEST(NvshmemAllToAll, SmallW2Bf16) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(small_w2_bf16_spec(kNVSHMEM));
}

TEST(NvshmemAllToAll, SmallW2Dp2Fp8SplitAccumulate) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(small_w2_dp2_fp8_split_accumulate_spec(kNVSHMEM));
}

TEST(NvshmemAllToAll, SmallW2StridedUint32WithNone) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(small_w2_strided_uint32_with_none_spec(kNVSHMEM));
}

// Many rounds: every counter the protocol resets (counts, arrivals, token
// bits, positions) and the cumulative barrier must stay in step.
TEST(NvshmemAllToAll, ManyRoundsW2Skewed) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(with(make_spec(kNVSHMEM, 2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16),
                    [](CaseSpec& s) {
                      s.rounds = 12;
                      s.routing = Routing::kSkewed;
                    }));
}

// Prefill-sized buffers (every SM by default) and m drawn up to T.
TEST(NvshmemAllToAll, PrefillW2Fp8) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(prefill_w2_fp8_spec(kNVSHMEM));
}

TEST(NvshmemAllToAll, PrefillW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_gpu_case(prefill_w4_dp2_spec(kNVSHMEM));
}

// One block per kernel: the count warp owns every expert, the pack warps
// every token.
TEST(NvshmemAllToAll, OneBlockW2Dp2) {
  REQUIRE_NVSHMEM(2);
  run_gpu_case(with(make_spec(kNVSHMEM, 2, 2, 64, 16, 8, 512, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) {
                      s.num_blocks = 1;
                      s.routing = Routing::kRepeated;
                    }));
}

class NvshmemAllToAllCase : public testing::TestWithParam<NamedCase> {};

TEST_P(NvshmemAllToAllCase, DispatchAndCombineMatchReference) {
  REQUIRE_NVSHMEM(GetParam().spec.world_size);
  run_gpu_case(GetParam().spec);
}

// The shared list with one-rank cases: a DeepSeek-like one first, and split,
// accumulating, repeated routes after the DeepSeek-like ones.
std::vector<NamedCase> eager_cases() {
  std::vector<NamedCase> v;
  v.push_back({"DeepSeekLike_W1", with(deepseek_spec(kNVSHMEM),
                                       [](CaseSpec& s) { s.world_size = 1; })});
  for (NamedCase& c : gpu_deepseek_cases(kNVSHMEM)) v.push_back(std::move(c));
  v.push_back({"W1_Split_Accumulate_Repeated",
               with(make_spec(kNVSHMEM, 1, 1, 32, 8, 4, 256, kFp8, kBf16, kFp32),
                    [](CaseSpec& s) {
                      s.split = true;
                      s.accumulate = true;
                      s.routing = Routing::kRepeated;
                    })});
  for (NamedCase& c : gpu_shape_cases(kNVSHMEM)) v.push_back(std::move(c));
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVSHMEM, NvshmemAllToAllCase, testing::ValuesIn(eager_cases()),
                         CaseName());

// ------------------------------------------------------------ one process, several AllToAlls

// NVSHMEM starts once per process; each AllToAll takes a symmetric buffer
// from the pool and gives it back when destroyed (no collective call), so
// a later AllToAll of a fitting size reuses it, zeroed, with fresh counters.
TEST(NvshmemAllToAll, SequentialAllToAllsShareTheRuntimeW2) {
  REQUIRE_NVSHMEM(2);
  const CaseSpec small = make_spec(kNVSHMEM, 2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16);
  const CaseSpec large = with(make_spec(kNVSHMEM, 2, 1, 64, 32, 8, 1024, kFp8, kBf16, kBf16),
                              [](CaseSpec& s) { s.routing = Routing::kRepeated; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_case_on_rank(large, rank, bs, ops);
    run_case_on_rank(small, rank, bs, ops);  // reuses the large buffer
    run_case_on_rank(with(large, [](CaseSpec& s) { s.seed = 7; }), rank, bs, ops);  // a new one
  }, 480);
}

// ------------------------------------------------------------ CUDA graphs

TEST(NvshmemAllToAll, SmallW2OneGraphReplays) {
  REQUIRE_NVSHMEM(2);
  run_one_graph_case(small_w2_one_graph_spec(kNVSHMEM));
}

TEST(NvshmemAllToAllGraph, OneGraphReplaysW1) {
  REQUIRE_NVSHMEM(1);
  run_one_graph_case(one_graph_fresh_routing_spec(kNVSHMEM, 1));
}

TEST(NvshmemAllToAllGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_one_graph_case(one_graph_split_other_work_w4_dp2_spec(kNVSHMEM));
}

TEST(NvshmemAllToAllGraph, OneGraphDeepSeekShapeBf16W2) {
  REQUIRE_NVSHMEM(2);
  run_one_graph_case(one_graph_deepseek_bf16_spec(kNVSHMEM, 2));
}

TEST(NvshmemAllToAllGraph, TwoGraphsDeepSeekFp8ReplaysW2) {
  REQUIRE_NVSHMEM(2);
  run_two_graph_case(deepseek_spec(kNVSHMEM));
}

TEST(NvshmemAllToAllGraph, TwoGraphsSplitRepeatedW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_two_graph_case(two_graph_split_repeated_w4_dp2_spec(kNVSHMEM));
}

// ------------------------------------------------------------ errors

class NvshmemAllToAllInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(NvshmemAllToAllInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_NVSHMEM(GetParam().spec.world_size);
  run_gpu_case(GetParam().spec);
}

// The shared list and an overflow on one rank.
std::vector<NamedCase> input_error_cases() {
  std::vector<NamedCase> v = gpu_input_error_cases(kNVSHMEM);
  v.push_back({"ExpertOverflow_W1",
               input_error_spec(kNVSHMEM, 1, 1, kFp8, Inject::kExpertOverflow)});
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVSHMEM, NvshmemAllToAllInputError, testing::ValuesIn(input_error_cases()),
                         CaseName());

TEST(NvshmemAllToAllTimeout, RankThatExitsIsNamedInTimeoutError) {
  REQUIRE_NVSHMEM(2);
  run_gpu_rank_exit(rank_exit_spec(kNVSHMEM, 2, 1), 1);
}

TEST(NvshmemAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutError) {
  REQUIRE_NVSHMEM(2);
  run_gpu_rank_exit(rank_exit_spec(kNVSHMEM, 2, 1), 1, /*before_combine=*/true);
}

TEST(NvshmemAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_gpu_rank_exit(rank_exit_spec(kNVSHMEM, 4, 2), 2);
}

}  // namespace
}  // namespace moelink_test
