// Dispatch/combine on the NVLink backend, through the same driver and
// reference as the CPU tests. Plain C++ on the CUDA runtime API (no kernels
// here: the "other work" between split halves is a cudaMemsetAsync). Built
// only with MOELINK_WITH_CUDA; every test skips itself on a machine without a
// GPU. Rank r uses GPU r % gpu_count, so 4 ranks run on 2 GPUs as well.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "all_to_all_cases.h"
#include "gpu_memory_ops.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using moelink::DType;

constexpr const char* kNoGpu =
    "no CUDA GPU on this machine: the NVLink tests run on the H200 device machine "
    "(tools/gpu_check.sh)";

#define REQUIRE_GPU()                                    \
  do {                                                   \
    if (probe_gpu_count() == 0) GTEST_SKIP() << kNoGpu;  \
  } while (0)

int device_of(int rank) { return rank % probe_gpu_count(); }

CaseSpec gpu(int W, int dp, int64_t T, int E, int k, int64_t H, DType in, DType out, DType y) {
  CaseSpec s;
  s.backend = moelink::Backend::kNVLink;
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

void run_gpu_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_case_on_rank(spec, rank, bs, ops);
  }, 480);
}

// ------------------------------------------------------------ eager cases

// Small cases, named GpuAllToAll.Small* for tools/gpu_check.sh's
// compute-sanitizer pass.
TEST(GpuAllToAll, SmallW2Bf16) {
  REQUIRE_GPU();
  run_gpu_case(gpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16));
}

TEST(GpuAllToAll, SmallW2Dp2Fp8SplitAccumulate) {
  REQUIRE_GPU();
  run_gpu_case(with(gpu(2, 2, 16, 8, 4, 256, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.accumulate = true;
    s.routing = Routing::kRepeated;
  }));
}

TEST(GpuAllToAll, SmallW2StridedUint32WithNone) {
  REQUIRE_GPU();
  run_gpu_case(with(gpu(2, 1, 16, 8, 3, 128, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.strided = true;
    s.index_dtype = DType::kUInt32;
    s.routing = Routing::kWithNone;
    s.input_rows = 11;
  }));
}

// Prefill-sized buffers (max_num_tokens * num_dp_groups >= 2048 rows per
// expert): the fused dispatch then overlaps its send and receive halves,
// publishing slots by their headers. m is random in [0, T], so slots past m
// and tokens without routes here must be recognised once their sender is done.
TEST(GpuAllToAll, PrefillOverlapW2Fp8) {
  REQUIRE_GPU();
  run_gpu_case(with(gpu(2, 1, 2048, 16, 4, 512, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.routing = Routing::kWithNone;
  }));
}

TEST(GpuAllToAll, PrefillOverlapW4Dp2) {
  REQUIRE_GPU();
  run_gpu_case(gpu(4, 2, 1024, 32, 8, 256, kBf16, kFp16, kBf16));
}

class GpuAllToAllCase : public testing::TestWithParam<NamedCase> {};

TEST_P(GpuAllToAllCase, DispatchAndCombineMatchReference) {
  REQUIRE_GPU();
  run_gpu_case(GetParam().spec);
}

std::vector<NamedCase> eager_cases() {
  std::vector<NamedCase> v;
  const CaseSpec deepseek = gpu(2, 1, 128, 256, 8, 7168, kFp8, kBf16, kBf16);
  v.push_back({"DeepSeekLike_W2", deepseek});
  v.push_back({"DeepSeekLike_W4_Dp2", with(deepseek, [](CaseSpec& s) {
                 s.world_size = 4;
                 s.dp_size = 2;
               })});
  v.push_back({"DeepSeekLike_W4_Split", with(deepseek, [](CaseSpec& s) {
                 s.world_size = 4;
                 s.split = true;
               })});
  v.push_back({"W2_Bf16_K1_E8", gpu(2, 1, 64, 8, 1, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Dp2_Fp16_K8_E8_YFp32", gpu(2, 2, 32, 8, 8, 512, kFp16, kFp16, kFp32)});
  v.push_back({"W4_Fp8_K4_E32_OutFp16_Int32",
               with(gpu(4, 1, 64, 32, 4, 2048, kFp8, kFp16, kBf16),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W4_Dp2_Bf16_K2_E16_Uint32",
               with(gpu(4, 2, 48, 16, 2, 4096, kBf16, kBf16, kFp16),
                    [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"W2_Accumulate_Split", with(gpu(2, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16),
                                           [](CaseSpec& s) {
                                             s.accumulate = true;
                                             s.split = true;
                                           })});
  v.push_back({"W4_Dp2_Strided_Fp8", with(gpu(4, 2, 32, 16, 4, 1024, kFp8, kBf16, kBf16),
                                          [](CaseSpec& s) { s.strided = true; })});
  v.push_back({"W2_Padded_Bf16_Accumulate", with(gpu(2, 1, 32, 16, 4, 1024, kBf16, kBf16, kFp32),
                                                 [](CaseSpec& s) {
                                                   s.padded = true;
                                                   s.accumulate = true;
                                                 })});
  v.push_back({"W4_Dp2_Padded_Fp8_FewerRows", with(gpu(4, 2, 32, 16, 8, 512, kFp8, kFp16, kBf16),
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
                 with(gpu(2, 1, 64, 16, 4, 512, kFp8, kBf16, kBf16),
                      [&](CaseSpec& s) { s.routing = routing; })});
    v.push_back({std::string("Routing") + name + "_W4_Dp2",
                 with(gpu(4, 2, 64, 8, 8, 256, kBf16, kFp16, kBf16), [&](CaseSpec& s) {
                   s.routing = routing;
                   s.index_dtype = DType::kInt32;
                 })});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVLink, GpuAllToAllCase, testing::ValuesIn(eager_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

// ------------------------------------------------------------ CUDA graphs

// Captures `fn`'s work on the ops' stream into an executable graph.
cudaGraphExec_t capture(MemoryOps& ops, const std::function<void()>& fn) {
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

void replay(MemoryOps& ops, cudaGraphExec_t exec) {
  CUDA_OK(cudaGraphLaunch(exec, ops.stream()));
  ops.sync();
}

constexpr int kReplays = 4;

// One graph holds dispatch, expert_y = out_expert_x (a device copy: the
// identity expert), and combine. Each replay runs on fresh routing, m and
// tokens written into the same input buffers.
void run_one_graph_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    CaseRunner runner(spec, rank, bs, ops);
    runner.run_round(0);  // eager, checked
    cudaGraphExec_t exec = capture(ops, [&] {
      runner.dispatch();
      CUDA_OK(cudaMemcpyAsync(runner.expert_y().data(), runner.out_expert_x().data(),
                              runner.out_expert_x().bytes(), cudaMemcpyDeviceToDevice,
                              ops.stream()));
      runner.combine();
    });
    for (int r = 1; r <= kReplays; ++r) {
      runner.prepare_round(r);
      replay(ops, exec);
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
// replays (so any expert function, e.g. on fp8 tokens, can be checked).
void run_two_graph_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    CaseRunner runner(spec, rank, bs, ops);
    runner.run_round(0);
    cudaGraphExec_t dispatch = capture(ops, [&] { runner.dispatch(); });
    cudaGraphExec_t combine = capture(ops, [&] { runner.combine(); });
    for (int r = 1; r <= kReplays; ++r) {
      runner.prepare_round(r);
      replay(ops, dispatch);
      runner.check_errors("dispatch");
      runner.check_dispatch();
      runner.write_expert_y();
      replay(ops, combine);
      runner.check_errors("combine");
      runner.check_combine();
      runner.check_guards();
    }
    cudaGraphExecDestroy(dispatch);
    cudaGraphExecDestroy(combine);
  }, 480);
}

TEST(GpuAllToAll, SmallW2OneGraphReplays) {
  REQUIRE_GPU();
  run_one_graph_case(with(gpu(2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(GpuAllToAllGraph, OneGraphReplaysWithFreshRoutingW2) {
  REQUIRE_GPU();
  run_one_graph_case(with(gpu(2, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(GpuAllToAllGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2) {
  REQUIRE_GPU();
  run_one_graph_case(with(gpu(4, 2, 64, 16, 4, 1024, kFp16, kFp16, kFp16), [](CaseSpec& s) {
    s.identity_expert = true;
    s.split = true;
    s.padded = true;
    s.routing = Routing::kWithNone;
  }));
}

TEST(GpuAllToAllGraph, OneGraphDeepSeekShapeBf16W4) {
  REQUIRE_GPU();
  run_one_graph_case(with(gpu(4, 1, 128, 256, 8, 7168, kBf16, kBf16, kBf16),
                          [](CaseSpec& s) { s.identity_expert = true; }));
}

TEST(GpuAllToAllGraph, TwoGraphsDeepSeekFp8ReplaysW2) {
  REQUIRE_GPU();
  run_two_graph_case(gpu(2, 1, 128, 256, 8, 7168, kFp8, kBf16, kBf16));
}

TEST(GpuAllToAllGraph, TwoGraphsSplitRepeatedW4Dp2) {
  REQUIRE_GPU();
  run_two_graph_case(with(gpu(4, 2, 64, 16, 8, 512, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.routing = Routing::kRepeated;
  }));
}

// ------------------------------------------------------------ errors

class GpuAllToAllInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(GpuAllToAllInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_GPU();
  run_gpu_case(GetParam().spec);
}

std::vector<NamedCase> input_error_cases() {
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_W2", with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                          [](CaseSpec& s) { s.inject = Inject::kExpertIdE; })});
  v.push_back({"ExpertIdMinus5_Int32_W4Dp2",
               with(gpu(4, 2, 32, 16, 4, 512, kFp8, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kInt32;
               })});
  v.push_back({"ExpertIdMinus5_Uint32_W2",
               with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kUInt32;
               })});
  v.push_back({"BoundMTooLarge_W2", with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMTooLarge; })});
  v.push_back({"BoundMPastInputRows_W4Dp2",
               with(gpu(4, 2, 32, 16, 4, 512, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.input_rows = 20;
                 s.inject = Inject::kBoundMTooLarge;
               })});
  v.push_back({"BoundMNegative_W2", with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMNegative; })});
  v.push_back({"ExpertOverflow_W2", with(gpu(2, 1, 32, 16, 4, 512, kFp8, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kExpertOverflow; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(NVLink, GpuAllToAllInputError, testing::ValuesIn(input_error_cases()),
                         [](const testing::TestParamInfo<NamedCase>& i) { return i.param.name; });

TEST(GpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutError) {
  REQUIRE_GPU();
  const CaseSpec spec = with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 1, bs, ops);
  }, 120);
}

TEST(GpuAllToAllTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutError) {
  REQUIRE_GPU();
  const CaseSpec spec = with(gpu(2, 1, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(2, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 1, bs, ops, /*exit_before_combine=*/true);
  }, 120);
}

TEST(GpuAllToAllTimeout, RankThatExitsIsNamedInTimeoutErrorW4Dp2) {
  REQUIRE_GPU();
  const CaseSpec spec = with(gpu(4, 2, 32, 16, 4, 512, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) { s.timeout_s = 3; });
  run_ranks(4, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, 2, bs, ops);
  }, 120);
}

}  // namespace
}  // namespace moelink_test
