// What the GPU backends' tests share (NVLink: test_gpu_all_to_all.cc,
// NVSHMEM: test_nvshmem_all_to_all.cc, internode: test_internode_gpu.cc):
// the runners (eager, CUDA graph, a rank that leaves) and the cases that
// more than one backend runs, built for a given backend. Each test file
// keeps its own skip checks, its backend's own cases and its test names.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "all_to_all_cases.h"
#include "case_builders.h"

namespace moelink_test {

// ------------------------------------------------------------ runners

// Rank r uses GPU r % gpu_count, so 4 ranks run on 2 GPUs (or 1) as well.
int device_of(int rank);

// Forks spec.world_size ranks, each on device_of(rank), and runs the case.
void run_gpu_case(const CaseSpec& spec);

// Captures `fn`'s work on the ops' stream into an executable graph.
cudaGraphExec_t capture_graph(MemoryOps& ops, const std::function<void()>& fn);
// Launches `exec` on the ops' stream and waits for it.
void replay_graph(MemoryOps& ops, cudaGraphExec_t exec);

// One graph holds dispatch, expert_y = out_expert_x (a device copy: the
// identity expert, so spec.identity_expert must be set), and combine. Each
// replay runs on fresh routing, m and tokens written into the same input
// buffers; eager rounds before and after the replays.
void run_one_graph_case(const CaseSpec& spec);

// Dispatch and combine in two graphs; the host computes expert_y between the
// replays (so any expert function, e.g. on fp8 tokens, can be checked).
void run_two_graph_case(const CaseSpec& spec);

// A good round, then `exiting_rank` leaves (before combine when
// `before_combine`); the others must see a TimeoutError naming it.
void run_gpu_rank_exit(const CaseSpec& spec, int exiting_rank, bool before_combine = false);

// ------------------------------------------------------------ shared cases

// DeepSeek-V3-like dispatch: 2 ranks, T 128, E 256, k 8, H 7168, fp8 in.
CaseSpec deepseek_spec(moelink::Backend backend);

// Parameterized eager cases: DeepSeekLike_W2, _W4_Dp2 and _W4_Split ...
std::vector<NamedCase> gpu_deepseek_cases(moelink::Backend backend);
// ... then shapes, dtypes, split / accumulate / strided / padded calls and
// every routing kind on 2 and 4 ranks ...
std::vector<NamedCase> gpu_shape_cases(moelink::Backend backend);
// ... both, in that order.
std::vector<NamedCase> gpu_eager_cases(moelink::Backend backend);

// Bad expert ids, bound_m and expert overflow: check() must throw an
// InputError and nothing may be written out of bounds.
CaseSpec input_error_spec(moelink::Backend backend, int W, int dp, moelink::DType in,
                          Inject what);  // T 32, E 16, k 4, H 512, bf16 out and y
std::vector<NamedCase> gpu_input_error_cases(moelink::Backend backend);

// Small cases, run under compute-sanitizer by the device scripts (their
// tests are named *.Small*).
CaseSpec small_w2_bf16_spec(moelink::Backend backend);
CaseSpec small_w2_dp2_fp8_split_accumulate_spec(moelink::Backend backend);
CaseSpec small_w2_strided_uint32_with_none_spec(moelink::Backend backend);

// Prefill-sized buffers (max_num_tokens * num_dp_groups >= 2048 rows per
// expert); m is random in [0, T].
CaseSpec prefill_w2_fp8_spec(moelink::Backend backend);
CaseSpec prefill_w4_dp2_spec(moelink::Backend backend);

// Graph cases. The one-graph ones set identity_expert.
CaseSpec small_w2_one_graph_spec(moelink::Backend backend);
CaseSpec one_graph_fresh_routing_spec(moelink::Backend backend, int world_size);
CaseSpec one_graph_split_other_work_w4_dp2_spec(moelink::Backend backend);
CaseSpec one_graph_deepseek_bf16_spec(moelink::Backend backend, int world_size);
CaseSpec two_graph_split_repeated_w4_dp2_spec(moelink::Backend backend);

// The rank-exit cases' spec: W ranks in DP groups of dp, a 3 s timeout.
CaseSpec rank_exit_spec(moelink::Backend backend, int W, int dp);

}  // namespace moelink_test
