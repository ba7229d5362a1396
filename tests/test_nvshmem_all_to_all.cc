// Dispatch/combine on the NVSHMEM backend, through the same driver and
// reference as the CPU and NVLink tests: the NVLink GPU case list (split
// halves, graph replays, skewed / empty / repeated routings, dp_size > 1,
// input errors, dead peers) plus one-rank cases and AllToAlls created one
// after another in one process (NVSHMEM is started once per process and its
// symmetric buffers are pooled).
//
// Rank r uses GPU r % gpu_count. Several ranks on one GPU are NVSHMEM
// "multiple PEs per GPU" (MPG): without MPS NVSHMEM runs it in a limited
// mode where its host-side collectives refuse to run, but P2P puts and
// signals between PEs of one device (all moelink uses) work. Set
// MOELINK_TEST_NVSHMEM_MPG=0 to skip every case that needs more ranks than
// GPUs. Every test skips itself, saying why, without a GPU or without
// NVSHMEM in the build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "all_to_all_cases.h"
#include "gpu_memory_ops.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using moelink::DType;

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

int device_of(int rank) { return rank % probe_gpu_count(); }

CaseSpec shm(int W, int dp, int64_t T, int E, int k, int64_t H, DType in, DType out, DType y) {
  CaseSpec s;
  s.backend = moelink::Backend::kNVSHMEM;
  s.world_size = W;
  s.dp_size = dp;
  s.max_num_tokens = T;
  s.num_experts = E;
  s.experts_per_token = k;
  s.hidden_dim = H;
  s.in_dtype = in;
  s.hidden_dim_scale = in == DType::kFloat8E4M3 ? static_cast<int>(std::max<int64_t>(H / 128, 1)) : 0;
  s.out_dtype = out;
  s.y_dtype = y;
  s.timeout_s = 30;
  return s;
}

template <typename F>
CaseSpec with(CaseSpec s, F f) {
  f(s);
  return s;
}

constexpr DType kFp8 = DType::kFloat8E4M3, kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16,
                kFp32 = DType::kFloat32;

struct NamedCase {
  std::string name;
  CaseSpec spec;
};
void PrintTo(const NamedCase& c, std::ostream* os) { *os << c.name << " " << c.spec.describe(); }
std::string case_name(const testing::TestParamInfo<NamedCase>& i) { return i.param.name; }

void run_shm_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_case_on_rank(spec, rank, bs, ops);
  }, 480);
}

// ------------------------------------------------------------ eager cases

// Small cases first: if NVSHMEM cannot start on this machine, these say so
// quickly. Named NvshmemAllToAll.Small* for a compute-sanitizer pass.
TEST(NvshmemAllToAll, SmallW1Bf16) {
  REQUIRE_NVSHMEM(1);
  run_shm_case(shm(1, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16));
}

TEST(NvshmemAllToAll, SmallW2Bf16) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(shm(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16));
}

TEST(NvshmemAllToAll, SmallW2Dp2Fp8SplitAccumulate) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(with(shm(2, 2, 16, 8, 4, 256, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.accumulate = true;
    s.routing = Routing::kRepeated;
  }));
}

TEST(NvshmemAllToAll, SmallW2StridedUint32WithNone) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(with(shm(2, 1, 16, 8, 3, 128, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.strided = true;
    s.index_dtype = DType::kUInt32;
    s.routing = Routing::kWithNone;
    s.input_rows = 11;
  }));
}

// Many rounds: every counter the protocol resets (counts, arrivals, token
// bits, positions) and the cumulative barrier must stay in step.
TEST(NvshmemAllToAll, ManyRoundsW2Skewed) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(with(shm(2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16), [](CaseSpec& s) {
    s.rounds = 12;
    s.routing = Routing::kSkewed;
  }));
}

// Prefill-sized buffers (every SM by default) and m drawn up to T.
TEST(NvshmemAllToAll, PrefillW2Fp8) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(with(shm(2, 1, 2048, 16, 4, 512, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.routing = Routing::kWithNone;
  }));
}

TEST(NvshmemAllToAll, PrefillW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_shm_case(shm(4, 2, 1024, 32, 8, 256, kBf16, kFp16, kBf16));
}

// One block per kernel: the count warp owns every expert, the pack warps
// every token.
TEST(NvshmemAllToAll, OneBlockW2Dp2) {
  REQUIRE_NVSHMEM(2);
  run_shm_case(with(shm(2, 2, 64, 16, 8, 512, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.num_blocks = 1;
    s.routing = Routing::kRepeated;
  }));
}

class NvshmemAllToAllCase : public testing::TestWithParam<NamedCase> {};

TEST_P(NvshmemAllToAllCase, DispatchAndCombineMatchReference) {
  REQUIRE_NVSHMEM(GetParam().spec.world_size);
  run_shm_case(GetParam().spec);
}

std::vector<NamedCase> eager_cases() {
  std::vector<NamedCase> v;
  const CaseSpec deepseek = shm(2, 1, 128, 256, 8, 7168, kFp8, kBf16, kBf16);
  v.push_back({"DeepSeekLike_W1", with(deepseek, [](CaseSpec& s) { s.world_size = 1; })});
  v.push_back({"DeepSeekLike_W2", deepseek});
  v.push_back({"DeepSeekLike_W4_Dp2", with(deepseek, [](CaseSpec& s) {
                 s.world_size = 4;
                 s.dp_size = 2;
               })});
  v.push_back({"DeepSeekLike_W4_Split", with(deepseek, [](CaseSpec& s) {
                 s.world_size = 4;
                 s.split = true;
               })});
  v.push_back({"W1_Split_Accumulate_Repeated",
               with(shm(1, 1, 32, 8, 4, 256, kFp8, kBf16, kFp32), [](CaseSpec& s) {
                 s.split = true;
                 s.accumulate = true;
                 s.routing = Routing::kRepeated;
               })});
  v.push_back({"W2_Bf16_K1_E8", shm(2, 1, 64, 8, 1, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Dp2_Fp16_K8_E8_YFp32", shm(2, 2, 32, 8, 8, 512, kFp16, kFp16, kFp32)});
  v.push_back({"W4_Fp8_K4_E32_OutFp16_Int32",
               with(shm(4, 1, 64, 32, 4, 2048, kFp8, kFp16, kBf16),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W4_Dp2_Bf16_K2_E16_Uint32",
               with(shm(4, 2, 48, 16, 2, 4096, kBf16, kBf16, kFp16),
                    [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"W2_Accumulate_Split", with(shm(2, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16),
                                           [](CaseSpec& s) {
                                             s.accumulate = true;
                                             s.split = true;
                                           })});
  v.push_back({"W4_Dp2_Strided_Fp8", with(shm(4, 2, 32, 16, 4, 1024, kFp8, kBf16, kBf16),
                                          [](CaseSpec& s) { s.strided = true; })});
  v.push_back({"W2_Padded_Bf16_Accumulate", with(shm(2, 1, 32, 16, 4, 1024, kBf16, kBf16, kFp32),
                                                 [](CaseSpec& s) {
                                                   s.padded = true;
                                                   s.accumulate = true;
                                                 })});
  v.push_back({"W4_Dp2_Padded_Fp8_FewerRows", with(shm(4, 2, 32, 16, 8, 512, kFp8, kFp16, kBf16),
                                                   [](CaseSpec& s) {
                                                     s.padded = true;
                                                     s.input_rows = 19;
                                                   })});
  const std::pair<Routing, const char*> routings[] = {{Routing::kUniform, "Uniform"},
                                                      {Routing::kSkewed, "Skewed"},
                                                      {Routing::kWithNone, "WithNone"},
                                                      {Routing::kRepeated, "Repeated"}};
  for (const auto& [routing, name] : routings) {
    v.push_back({std::string("Routing") + name + "_W2",
                 with(shm(2, 1, 64, 16, 4, 512, kFp8, kBf16, kBf16),
                      [&](CaseSpec& s) { s.routing = routing; })});
    v.push_back({std::string("Routing") + name + "_W4_Dp2",
                 with(shm(4, 2, 64, 8, 8, 256, kBf16, kFp16, kBf16), [&](CaseSpec& s) {
                   s.routing = routing;
                   s.index_dtype = DType::kInt32;
                 })});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVSHMEM, NvshmemAllToAllCase, testing::ValuesIn(eager_cases()), case_name);

// ------------------------------------------------------------ one process, several AllToAlls

// NVSHMEM starts once per process; each AllToAll takes a symmetric buffer
// from the pool and gives it back when destroyed (no collective call), so
// a later AllToAll of a fitting size reuses it, zeroed, with fresh counters.
TEST(NvshmemAllToAll, SequentialAllToAllsShareTheRuntimeW2) {
  REQUIRE_NVSHMEM(2);
  const CaseSpec small = shm(2, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16);
  const CaseSpec large = with(shm(2, 1, 64, 32, 8, 1024, kFp8, kBf16, kBf16),
                              [](CaseSpec& s) { s.routing = Routing::kRepeated; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_case_on_rank(large, rank, bs, ops);
    run_case_on_rank(small, rank, bs, ops);  // reuses the large buffer
    run_case_on_rank(with(large, [](CaseSpec& s) { s.seed = 7; }), rank, bs, ops);  // a new one
  }, 480);
}

// ------------------------------------------------------------ CUDA graphs

constexpr int kReplays = 4;

// Captures `fn`'s work on the ops' stream into an executable graph.
cudaGraphExec_t capture_graph(MemoryOps& ops, const std::function<void()>& fn) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(ops.stream(), cudaStreamCaptureModeThreadLocal));
  try {
    fn();
  } catch (...) {
    cudaStreamEndCapture(ops.stream(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  CUDA_OK(cudaStreamEndCapture(ops.stream(), &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  return exec;
}

void replay_graph(MemoryOps& ops, cudaGraphExec_t exec) {
  CUDA_OK(cudaGraphLaunch(exec, ops.stream()));
  ops.sync();
}

// One graph holds dispatch, expert_y = out_expert_x (a device copy: the
// identity expert), and combine; each replay runs on fresh routing, m and
// tokens written into the same input buffers.
void run_one_graph_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    CaseRunner runner(spec, rank, bs, ops);
    runner.run_round(0);  // eager, checked
    cudaGraphExec_t exec = capture_graph(ops, [&] {
      runner.dispatch();
      CUDA_OK(cudaMemcpyAsync(runner.expert_y().data(), runner.out_expert_x().data(),
                                           runner.out_expert_x().bytes(),
                                           cudaMemcpyDeviceToDevice, ops.stream()));
      runner.combine();
    });
    for (int r = 1; r <= kReplays; ++r) {
      runner.prepare_round(r);
      replay_graph(ops, exec);
      runner.check_errors("combine");
      runner.check_dispatch();
      runner.check_combine();
      runner.check_guards();
    }
    cudaGraphExecDestroy(exec);
    runner.run_round(kReplays + 1);  // eager again after the replays
  }, 480);
}

// Dispatch and combine in two graphs; the host computes expert_y between the
// replays.
void run_two_graph_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    CaseRunner runner(spec, rank, bs, ops);
    runner.run_round(0);
    cudaGraphExec_t dispatch = capture_graph(ops, [&] { runner.dispatch(); });
    cudaGraphExec_t combine = capture_graph(ops, [&] { runner.combine(); });
    for (int r = 1; r <= kReplays; ++r) {
      runner.prepare_round(r);
      replay_graph(ops, dispatch);
      runner.check_errors("dispatch");
      runner.check_dispatch();
      runner.write_expert_y();
      replay_graph(ops, combine);
      runner.check_errors("combine");
      runner.check_combine();
      runner.check_guards();
    }
    cudaGraphExecDestroy(dispatch);
    cudaGraphExecDestroy(combine);
  }, 480);
}

TEST(NvshmemAllToAll, SmallW2OneGraphReplays) {
  REQUIRE_NVSHMEM(2);
  run_one_graph_case(with(shm(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(NvshmemAllToAllGraph, OneGraphReplaysW1) {
  REQUIRE_NVSHMEM(1);
  run_one_graph_case(with(shm(1, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(NvshmemAllToAllGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_one_graph_case(with(shm(4, 2, 64, 16, 4, 1024, kFp16, kFp16, kFp16), [](CaseSpec& s) {
    s.identity_expert = true;
    s.split = true;
    s.padded = true;
    s.routing = Routing::kWithNone;
  }));
}

TEST(NvshmemAllToAllGraph, OneGraphDeepSeekShapeBf16W2) {
  REQUIRE_NVSHMEM(2);
  run_one_graph_case(with(shm(2, 1, 128, 256, 8, 7168, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(NvshmemAllToAllGraph, TwoGraphsDeepSeekFp8ReplaysW2) {
  REQUIRE_NVSHMEM(2);
  run_two_graph_case(shm(2, 1, 128, 256, 8, 7168, kFp8, kBf16, kBf16));
}

TEST(NvshmemAllToAllGraph, TwoGraphsSplitRepeatedW4Dp2) {
  REQUIRE_NVSHMEM(4);
  run_two_graph_case(with(shm(4, 2, 64, 16, 8, 512, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.routing = Routing::kRepeated;
  }));
}

// ------------------------------------------------------------ errors

class NvshmemAllToAllInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(NvshmemAllToAllInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_NVSHMEM(GetParam().spec.world_size);
  run_shm_case(GetParam().spec);
}

std::vector<NamedCase> input_error_cases() {
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_W2", with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                          [](CaseSpec& s) { s.inject = Inject::kExpertIdE; })});
  v.push_back({"ExpertIdMinus5_Int32_W4Dp2",
               with(shm(4, 2, 32, 16, 4, 512, kFp8, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kInt32;
               })});
  v.push_back({"ExpertIdMinus5_Uint32_W2",
               with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kUInt32;
               })});
  v.push_back({"BoundMTooLarge_W2", with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMTooLarge; })});
  v.push_back({"BoundMPastInputRows_W4Dp2",
               with(shm(4, 2, 32, 16, 4, 512, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.input_rows = 20;
                 s.inject = Inject::kBoundMTooLarge;
               })});
  v.push_back({"BoundMNegative_W2", with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMNegative; })});
  v.push_back({"ExpertOverflow_W2", with(shm(2, 1, 32, 16, 4, 512, kFp8, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kExpertOverflow; })});
  v.push_back({"ExpertOverflow_W1", with(shm(1, 1, 32, 16, 4, 512, kFp8, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kExpertOverflow; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVSHMEM, NvshmemAllToAllInputError, testing::ValuesIn(input_error_cases()),
                         case_name);

TEST(NvshmemAllToAllTimeout, RankThatExitsIsNamedInTimeoutError) {
  REQUIRE_NVSHMEM(2);
  const CaseSpec spec = with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 1, bs, ops);
  }, 120);
}

TEST(NvshmemAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutError) {
  REQUIRE_NVSHMEM(2);
  const CaseSpec spec = with(shm(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 1, bs, ops, /*exit_before_combine=*/true);
  }, 120);
}

TEST(NvshmemAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW4Dp2) {
  REQUIRE_NVSHMEM(4);
  const CaseSpec spec = with(shm(4, 2, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(4, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 2, bs, ops);
  }, 120);
}

}  // namespace
}  // namespace moelink_test
