// The inter-node backend with GPU kernels (kInternode): forked ranks, one
// GPU each (rank r on GPU r % gpu_count, so several ranks share one GPU as
// well), checked by the shared driver against tests/reference.h. Most
// cases reach every peer through libfabric (shm here: GPUs of one machine
// treated as nodes, host staging, node_size = 1); the Nodes* cases group
// the ranks into nodes whose members exchange slots and rows over CUDA IPC
// (NVLink between GPUs; the same memory path when ranks share a GPU).
// Skips without a GPU or without the provider.
// The runners and some specs are shared with the other GPU backends
// (gpu_cases.h); the case lists are this backend's own (private tokens,
// other shapes, a subset of the input errors).
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>
#include <vector>

#include "fabric_test_util.h"
#include "gpu_cases.h"
#include "gpu_memory_ops.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using moelink::DType;

#define REQUIRE_GPU_AND_SHM()                                                              \
  do {                                                                                     \
    if (probe_gpu_count() == 0)                                                            \
      GTEST_SKIP() << "no CUDA GPU on this machine: the internode GPU tests run on the "   \
                      "H200 device machine (tools/gpu_check.sh)";                         \
    if (!fabric_provider_available("shm"))                                                 \
      GTEST_SKIP() << "libfabric provider 'shm' is not available here";                    \
  } while (0)

constexpr moelink::Backend kInternode = moelink::Backend::kInternode;

CaseSpec on_shm(CaseSpec s) {
  s.fabric_provider = "shm";
  return s;
}

CaseSpec gpu_node(int W, int dp, int64_t T, int E, int k, int64_t H, DType in, DType out, DType y) {
  return on_shm(make_spec(kInternode, W, dp, T, E, k, H, in, out, y));
}

class InternodeGpu : public testing::TestWithParam<NamedCase> {};

TEST_P(InternodeGpu, DispatchAndCombineMatchReference) {
  REQUIRE_GPU_AND_SHM();
  run_gpu_case(GetParam().spec);
}

std::vector<NamedCase> cases() {
  std::vector<NamedCase> v;
  const CaseSpec deepseek = with(on_shm(deepseek_spec(kInternode)),
                                 [](CaseSpec& s) { s.rounds = 3; });
  v.push_back({"DeepSeekLike_W2", deepseek});
  v.push_back({"DeepSeekLike_W2_Private0", with(deepseek, [](CaseSpec& s) {
                 s.max_private_tokens = 0;
                 s.routing = Routing::kSkewed;
               })});
  v.push_back({"DeepSeekLike_W4_Dp2_Split", with(deepseek, [](CaseSpec& s) {
                 s.world_size = 4;
                 s.dp_size = 2;
                 s.max_num_tokens = 32;
                 s.split = true;
               })});
  v.push_back({"W2_Bf16_K1_E8", gpu_node(2, 1, 64, 8, 1, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Dp2_Fp16_K8_E8_YFp32", gpu_node(2, 2, 32, 8, 8, 512, kFp16, kFp16, kFp32)});
  v.push_back({"W4_Fp8_K4_E32_OutFp16_Int32",
               with(gpu_node(4, 1, 32, 32, 4, 1024, kFp8, kFp16, kBf16),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W2_Accumulate_Split_Private1",
               with(gpu_node(2, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.accumulate = true;
                 s.split = true;
                 s.max_private_tokens = 1;
               })});
  v.push_back({"W4_Dp2_Strided_Padded_Fp8_FewerRows",
               with(gpu_node(4, 2, 32, 16, 8, 512, kFp8, kFp16, kBf16), [](CaseSpec& s) {
                 s.strided = true;
                 s.padded = true;
                 s.input_rows = 20;
               })});
  const std::pair<Routing, const char*> routings[] = {{Routing::kSkewed, "Skewed"},
                                                      {Routing::kWithNone, "WithNone"},
                                                      {Routing::kRepeated, "Repeated"}};
  for (const auto& [routing, name] : routings)
    v.push_back({std::string("Routing") + name + "_W4_Uint32",
                 with(gpu_node(4, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16), [&](CaseSpec& s) {
                   s.routing = routing;
                   s.index_dtype = DType::kUInt32;
                 })});
  v.push_back({"W1_Bf16_K2_E8", gpu_node(1, 1, 32, 8, 2, 256, kBf16, kBf16, kBf16)});
  // Node peers over CUDA IPC: a whole node, two nodes of two, DP groups
  // inside and across nodes, the host-name default.
  const auto nodes = [](int node_size, CaseSpec s) {
    s.node_size = node_size;
    return s;
  };
  v.push_back({"Nodes2_DeepSeekLike_W2", nodes(2, deepseek)});
  v.push_back({"Nodes2_DeepSeekLike_W4_Dp2_Split", nodes(2, with(deepseek, [](CaseSpec& s) {
                                                            s.world_size = 4;
                                                            s.dp_size = 2;
                                                            s.max_num_tokens = 32;
                                                            s.split = true;
                                                          }))});
  v.push_back({"Nodes2_W4_Dp4_GroupSpansNodes_Fp8",
               nodes(2, gpu_node(4, 4, 32, 16, 4, 512, kFp8, kBf16, kBf16))});
  v.push_back({"Nodes2_W4_Skewed_Private0_Uint32",
               nodes(2, with(gpu_node(4, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16),
                             [](CaseSpec& s) {
                               s.routing = Routing::kSkewed;
                               s.max_private_tokens = 0;
                               s.index_dtype = DType::kUInt32;
                             }))});
  v.push_back({"Nodes4_W4_Dp2_Accumulate_Strided_Padded",
               nodes(4, with(gpu_node(4, 2, 32, 16, 8, 512, kFp8, kFp16, kBf16),
                             [](CaseSpec& s) {
                               s.accumulate = true;
                               s.strided = true;
                               s.padded = true;
                               s.input_rows = 20;
                             }))});
  v.push_back({"Nodes2_W4_Repeated_K8_E8",
               nodes(2, with(gpu_node(4, 1, 32, 8, 8, 256, kBf16, kBf16, kFp32),
                             [](CaseSpec& s) { s.routing = Routing::kRepeated; }))});
  v.push_back({"NodesByHost_W4_WithNone",
               nodes(0, with(gpu_node(4, 1, 32, 16, 4, 256, kFp16, kBf16, kBf16),
                             [](CaseSpec& s) { s.routing = Routing::kWithNone; }))});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shm, InternodeGpu, testing::ValuesIn(cases()), CaseName());

// ------------------------------------------------------------ GPUDirect

// Why a one-rank internode AllToAll with GPU buffers (gpu_direct = 1) cannot
// be created over shm here ("" when it can), asked in a forked child so the
// test process keeps no CUDA context.
std::string gpu_direct_refusal() {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    std::string why;
    try {
      // One rank listens on nothing, so any port will do.
      auto bs = moelink::make_tcp_bootstrap(0, 1, "127.0.0.1", 65000, 10.0);
      CaseSpec s = gpu_node(1, 1, 8, 8, 2, 128, kBf16, kBf16, kBf16);
      moelink::Options o;
      o.backend = kInternode;
      o.fabric_provider = "shm";
      o.gpu_direct = 1;
      moelink::AllToAll::create(s.config(0), *bs, o);
    } catch (const std::exception& e) {
      why = e.what();
      if (why.empty()) why = "(no message)";
    }
    (void)!write(fds[1], why.data(), why.size());
    _exit(0);
  }
  close(fds[1]);
  std::string why;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) why.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status)) return "the probe crashed";
  return why;
}

// The send and receive buffers in device memory, registered with FI_HMEM:
// the GPUDirect path. Runs only where shm takes CUDA memory (a libfabric
// built with CUDA support); elsewhere it says why it skips.
TEST(InternodeGpuDirect, DeviceBuffersMatchReference) {
  REQUIRE_GPU_AND_SHM();
  const std::string why = gpu_direct_refusal();
  if (!why.empty()) GTEST_SKIP() << "shm does not take GPU buffers here: " << why;
  const CaseSpec deepseek = on_shm(deepseek_spec(kInternode));
  run_gpu_case(with(deepseek, [](CaseSpec& s) { s.gpu_direct = 1; }));
  run_gpu_case(with(deepseek, [](CaseSpec& s) {
    s.gpu_direct = 1;
    s.world_size = 4;
    s.dp_size = 2;
    s.node_size = 2;
    s.max_num_tokens = 32;
    s.split = true;
  }));
}

// ------------------------------------------------------------ bad input

// A subset of the NVLink / NVSHMEM list (gpu_input_error_cases), with bf16
// tokens for the int32 case.
std::vector<NamedCase> input_error_cases() {
  const auto bad = [](int W, int dp, DType in, Inject what) {
    return on_shm(input_error_spec(kInternode, W, dp, in, what));
  };
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_W2", bad(2, 1, kBf16, Inject::kExpertIdE)});
  v.push_back({"ExpertIdMinus5_Int32_W4Dp2",
               with(bad(4, 2, kBf16, Inject::kExpertIdMinus5),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"BoundMTooLarge_W2", bad(2, 1, kBf16, Inject::kBoundMTooLarge)});
  v.push_back({"BoundMNegative_W2", bad(2, 1, kBf16, Inject::kBoundMNegative)});
  v.push_back({"ExpertOverflow_W2", bad(2, 1, kFp8, Inject::kExpertOverflow)});
  return v;
}

class InternodeGpuInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(InternodeGpuInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_GPU_AND_SHM();
  run_gpu_case(GetParam().spec);
}

INSTANTIATE_TEST_SUITE_P(Shm, InternodeGpuInputError, testing::ValuesIn(input_error_cases()),
                         CaseName());

// ------------------------------------------------------------ a rank leaves

void run_exit(int W, int dp, int exiting, bool before_combine) {
  run_gpu_rank_exit(on_shm(rank_exit_spec(kInternode, W, dp)), exiting, before_combine);
}

TEST(InternodeGpuTimeout, RankThatExitsIsNamedInTimeoutError) {
  REQUIRE_GPU_AND_SHM();
  run_exit(2, 1, 1, false);
}

TEST(InternodeGpuTimeout, RankThatExitsBeforeCombineIsNamedInTimeoutErrorW4Dp2) {
  REQUIRE_GPU_AND_SHM();
  run_exit(4, 2, 2, true);
}

TEST(InternodeGpuTimeout, NodePeerThatExitsIsNamedInTimeoutErrorW4Nodes2) {
  REQUIRE_GPU_AND_SHM();
  run_gpu_rank_exit(with(on_shm(rank_exit_spec(kInternode, 4, 1)),
                         [](CaseSpec& s) { s.node_size = 2; }),
                    1, false);
}

// ------------------------------------------------------------ graphs

// The handshake with the proxy uses constants only and the epoch lives on
// the device, so captured graphs replay with fresh routing and m.
TEST(InternodeGpuGraph, OneGraphReplaysWithFreshRoutingW2) {
  REQUIRE_GPU_AND_SHM();
  run_one_graph_case(on_shm(one_graph_fresh_routing_spec(kInternode, 2)));
}

TEST(InternodeGpuGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2) {
  REQUIRE_GPU_AND_SHM();
  run_one_graph_case(on_shm(one_graph_split_other_work_w4_dp2_spec(kInternode)));
}

TEST(InternodeGpuGraph, TwoGraphsDeepSeekFp8ReplaysW2) {
  REQUIRE_GPU_AND_SHM();
  run_two_graph_case(on_shm(deepseek_spec(kInternode)));
}

TEST(InternodeGpuGraph, TwoGraphsSplitRepeatedW4Dp2) {
  REQUIRE_GPU_AND_SHM();
  run_two_graph_case(on_shm(two_graph_split_repeated_w4_dp2_spec(kInternode)));
}

TEST(InternodeGpuGraph, OneGraphSplitWithOtherWorkReplaysW4Dp2Nodes2) {
  REQUIRE_GPU_AND_SHM();
  run_one_graph_case(with(on_shm(one_graph_split_other_work_w4_dp2_spec(kInternode)),
                          [](CaseSpec& s) { s.node_size = 2; }));
}

TEST(InternodeGpuGraph, TwoGraphsDeepSeekFp8ReplaysW2Nodes2) {
  REQUIRE_GPU_AND_SHM();
  run_two_graph_case(with(on_shm(deepseek_spec(kInternode)), [](CaseSpec& s) { s.node_size = 2; }));
}

}  // namespace
}  // namespace moelink_test
