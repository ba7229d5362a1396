#include "gpu_cases.h"

#include <string>
#include <utility>

#include "gpu_memory_ops.h"
#include "rank_harness.h"

namespace moelink_test {

using moelink::Backend;
using moelink::DType;

namespace {

constexpr int kCaseTimeoutS = 480;
constexpr int kRankExitTimeoutS = 120;
constexpr int kReplays = 4;

void append(std::vector<NamedCase>& to, std::vector<NamedCase> from) {
  for (NamedCase& c : from) to.push_back(std::move(c));
}

}  // namespace

// ------------------------------------------------------------ runners

int device_of(int rank) { return rank % probe_gpu_count(); }

void run_gpu_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_case_on_rank(spec, rank, bs, ops);
  }, kCaseTimeoutS);
}

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

void run_one_graph_case(const CaseSpec& spec) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    CaseRunner runner(spec, rank, bs, ops);
    runner.run_round(0);  // eager, checked
    cudaGraphExec_t exec = capture_graph(ops, [&] {
      runner.dispatch();
      CUDA_OK(cudaMemcpyAsync(runner.expert_y().data(), runner.out_expert_x().data(),
                              runner.out_expert_x().bytes(), cudaMemcpyDeviceToDevice,
                              ops.stream()));
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
  }, kCaseTimeoutS);
}

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
  }, kCaseTimeoutS);
}

void run_gpu_rank_exit(const CaseSpec& spec, int exiting_rank, bool before_combine) {
  run_ranks(spec.world_size, [&](int rank, moelink::Bootstrap& bs) {
    GpuMemoryOps ops(device_of(rank));
    run_rank_exit_case(spec, rank, exiting_rank, bs, ops, before_combine);
  }, kRankExitTimeoutS);
}

// ------------------------------------------------------------ shared cases

CaseSpec deepseek_spec(Backend b) {
  return make_spec(b, 2, 1, 128, 256, 8, 7168, kFp8, kBf16, kBf16);
}

std::vector<NamedCase> gpu_deepseek_cases(Backend b) {
  std::vector<NamedCase> v;
  v.push_back({"DeepSeekLike_W2", deepseek_spec(b)});
  v.push_back({"DeepSeekLike_W4_Dp2", with(deepseek_spec(b), [](CaseSpec& s) {
                 s.world_size = 4;
                 s.dp_size = 2;
               })});
  v.push_back({"DeepSeekLike_W4_Split", with(deepseek_spec(b), [](CaseSpec& s) {
                 s.world_size = 4;
                 s.split = true;
               })});
  return v;
}

std::vector<NamedCase> gpu_shape_cases(Backend b) {
  std::vector<NamedCase> v;
  v.push_back({"W2_Bf16_K1_E8", make_spec(b, 2, 1, 64, 8, 1, 256, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Dp2_Fp16_K8_E8_YFp32", make_spec(b, 2, 2, 32, 8, 8, 512, kFp16, kFp16, kFp32)});
  v.push_back({"W4_Fp8_K4_E32_OutFp16_Int32",
               with(make_spec(b, 4, 1, 64, 32, 4, 2048, kFp8, kFp16, kBf16),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W4_Dp2_Bf16_K2_E16_Uint32",
               with(make_spec(b, 4, 2, 48, 16, 2, 4096, kBf16, kBf16, kFp16),
                    [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"W2_Accumulate_Split",
               with(make_spec(b, 2, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.accumulate = true;
                 s.split = true;
               })});
  v.push_back({"W4_Dp2_Strided_Fp8",
               with(make_spec(b, 4, 2, 32, 16, 4, 1024, kFp8, kBf16, kBf16),
                    [](CaseSpec& s) { s.strided = true; })});
  v.push_back({"W2_Padded_Bf16_Accumulate",
               with(make_spec(b, 2, 1, 32, 16, 4, 1024, kBf16, kBf16, kFp32), [](CaseSpec& s) {
                 s.padded = true;
                 s.accumulate = true;
               })});
  v.push_back({"W4_Dp2_Padded_Fp8_FewerRows",
               with(make_spec(b, 4, 2, 32, 16, 8, 512, kFp8, kFp16, kBf16), [](CaseSpec& s) {
                 s.padded = true;
                 s.input_rows = 19;
               })});
  const std::pair<Routing, const char*> routings[] = {{Routing::kUniform, "Uniform"},
                                                      {Routing::kSkewed, "Skewed"},
                                                      {Routing::kWithNone, "WithNone"},
                                                      {Routing::kRepeated, "Repeated"}};
  for (const auto& [routing, name] : routings) {
    v.push_back({std::string("Routing") + name + "_W2",
                 with(make_spec(b, 2, 1, 64, 16, 4, 512, kFp8, kBf16, kBf16),
                      [&](CaseSpec& s) { s.routing = routing; })});
    v.push_back({std::string("Routing") + name + "_W4_Dp2",
                 with(make_spec(b, 4, 2, 64, 8, 8, 256, kBf16, kFp16, kBf16), [&](CaseSpec& s) {
                   s.routing = routing;
                   s.index_dtype = DType::kInt32;
                 })});
  }
  return v;
}

std::vector<NamedCase> gpu_eager_cases(Backend b) {
  std::vector<NamedCase> v = gpu_deepseek_cases(b);
  append(v, gpu_shape_cases(b));
  return v;
}

CaseSpec input_error_spec(Backend b, int W, int dp, DType in, Inject what) {
  return with(make_spec(b, W, dp, 32, 16, 4, 512, in, kBf16, kBf16),
              [&](CaseSpec& s) { s.inject = what; });
}

std::vector<NamedCase> gpu_input_error_cases(Backend b) {
  const auto inject = [b](int W, int dp, DType in, Inject what) {
    return input_error_spec(b, W, dp, in, what);
  };
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_W2", inject(2, 1, kBf16, Inject::kExpertIdE)});
  v.push_back({"ExpertIdMinus5_Int32_W4Dp2",
               with(inject(4, 2, kFp8, Inject::kExpertIdMinus5),
                    [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"ExpertIdMinus5_Uint32_W2",
               with(inject(2, 1, kBf16, Inject::kExpertIdMinus5),
                    [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"BoundMTooLarge_W2", inject(2, 1, kBf16, Inject::kBoundMTooLarge)});
  v.push_back({"BoundMPastInputRows_W4Dp2",
               with(inject(4, 2, kBf16, Inject::kBoundMTooLarge),
                    [](CaseSpec& s) { s.input_rows = 20; })});
  v.push_back({"BoundMNegative_W2", inject(2, 1, kBf16, Inject::kBoundMNegative)});
  v.push_back({"ExpertOverflow_W2", inject(2, 1, kFp8, Inject::kExpertOverflow)});
  return v;
}

CaseSpec small_w2_bf16_spec(Backend b) {
  return make_spec(b, 2, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16);
}

CaseSpec small_w2_dp2_fp8_split_accumulate_spec(Backend b) {
  return with(make_spec(b, 2, 2, 16, 8, 4, 256, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.accumulate = true;
    s.routing = Routing::kRepeated;
  });
}

CaseSpec small_w2_strided_uint32_with_none_spec(Backend b) {
  return with(make_spec(b, 2, 1, 16, 8, 3, 128, kFp8, kBf16, kBf16), [](CaseSpec& s) {
    s.strided = true;
    s.index_dtype = DType::kUInt32;
    s.routing = Routing::kWithNone;
    s.input_rows = 11;
  });
}

CaseSpec prefill_w2_fp8_spec(Backend b) {
  return with(make_spec(b, 2, 1, 2048, 16, 4, 512, kFp8, kBf16, kBf16),
              [](CaseSpec& s) { s.routing = Routing::kWithNone; });
}

CaseSpec prefill_w4_dp2_spec(Backend b) {
  return make_spec(b, 4, 2, 1024, 32, 8, 256, kBf16, kFp16, kBf16);
}

CaseSpec small_w2_one_graph_spec(Backend b) {
  return with(small_w2_bf16_spec(b), [](CaseSpec& s) { s.identity_expert = true; });
}

CaseSpec one_graph_fresh_routing_spec(Backend b, int world_size) {
  return with(make_spec(b, world_size, 1, 64, 16, 4, 1024, kBf16, kBf16, kBf16),
              [](CaseSpec& s) { s.identity_expert = true; });
}

CaseSpec one_graph_split_other_work_w4_dp2_spec(Backend b) {
  return with(make_spec(b, 4, 2, 64, 16, 4, 1024, kFp16, kFp16, kFp16), [](CaseSpec& s) {
    s.identity_expert = true;
    s.split = true;
    s.padded = true;
    s.routing = Routing::kWithNone;
  });
}

CaseSpec one_graph_deepseek_bf16_spec(Backend b, int world_size) {
  return with(make_spec(b, world_size, 1, 128, 256, 8, 7168, kBf16, kBf16, kBf16),
              [](CaseSpec& s) { s.identity_expert = true; });
}

CaseSpec two_graph_split_repeated_w4_dp2_spec(Backend b) {
  return with(make_spec(b, 4, 2, 64, 16, 8, 512, kFp8, kFp16, kFp32), [](CaseSpec& s) {
    s.split = true;
    s.routing = Routing::kRepeated;
  });
}

CaseSpec rank_exit_spec(Backend b, int W, int dp) {
  return with(make_spec(b, W, dp, 32, 16, 4, 512, kBf16, kBf16, kBf16),
              [](CaseSpec& s) { s.timeout_s = 3; });
}

}  // namespace moelink_test
