// AllToAll: MoE dispatch (tokens to the ranks holding their experts) and
// combine (expert outputs back, summed with the router weights).
//
// Notation: W = world_size, D = dp_size, G = W / D data-parallel groups,
// E = num_experts, L = E / W local experts, k = experts_per_token,
// T = max_num_tokens, H = hidden_dim, S = hidden_dim_scale, C = T * G rows per
// local expert. All tensors are strided views (moelink::Tensor); "row
// contiguous" means the last dimension has stride 1 and rows start 16-byte
// aligned. Device memory for Backend::kNVLink, host memory for kCPU.
#pragma once

#include <memory>
#include <string>

#include "moelink/bootstrap.h"
#include "moelink/config.h"
#include "moelink/types.h"

namespace moelink {

enum class Backend {
  kNVLink,  // GPUs of one node, peer-mapped memory, GPU-initiated transfers
  kCPU,     // processes of one host, POSIX shared memory, CPU loops
  // GPUs of one or more nodes: NVSHMEM symmetric memory and GPU-initiated
  // puts/signals (src/nvshmem). Needs a build with NVSHMEM.
  kNVSHMEM,
  // Ranks on different nodes: a host proxy drives the TransferEngine
  // (libfabric) with GPU kernels packing and unpacking (src/internode).
  // Needs a build with libfabric.
  kInternode,
  // The same inter-node protocol, proxy and engine with CPU loops in place
  // of kernels: host tensors, no GPU (CI, tests).
  kInternodeCPU,
};

// "nvlink", "cpu", "nvshmem", "internode", "internode-cpu".
const char* backend_name(Backend b);
// True for the backends whose tensors live in host memory.
inline bool backend_uses_host_memory(Backend b) {
  return b == Backend::kCPU || b == Backend::kInternodeCPU;
}

struct Options {
  Backend backend = Backend::kNVLink;
  // Thread blocks (of 512 threads) per kernel (NVLink): each kernel holds at
  // most this many SMs. 0 picks the default: 64 when
  // max_num_tokens * num_dp_groups < 2048 (decode), else every SM (prefill).
  // Must resolve to the same value on every rank.
  int num_blocks = 0;
  // Seconds any wait for a peer may take before it fails. < 0: read
  // MOELINK_TIMEOUT_S, default 30.
  double timeout_s = -1.0;
  // Run check() after every call (synchronizing the stream). < 0: read
  // MOELINK_DEBUG.
  int debug = -1;

  // ---- kInternode / kInternodeCPU only
  // libfabric provider: "efa", "shm", "tcp", or "" to read
  // MOELINK_FABRIC_PROVIDER, else the first of efa, shm, tcp offered.
  std::string fabric_provider;
  // NICs (libfabric domains) per rank; peers are sharded across them, each
  // NIC pair driven by one worker thread. 0: MOELINK_FABRIC_NICS, else 1.
  int fabric_nics = 0;
  // Tokens per (sender, receiver) pair that go out with the routing
  // information, before offsets are known (private receive space per
  // sender). < 0: min(max_num_tokens, 32).
  int max_private_tokens = -1;
  // Ranks per node: that many consecutive ranks exchange tokens and combine
  // rows directly (kInternode: NVLink through CUDA IPC; kInternodeCPU:
  // shared memory), only other nodes go through the NIC. Must divide
  // world_size. 1: every peer through the NIC (how two GPUs of one host act
  // as two nodes). 0: the ranks that share this rank's host name, when they
  // form equal consecutive blocks, else 1. < 0: read MOELINK_NODE_SIZE, else
  // 0. Must resolve to the same value on every rank.
  int node_size = -1;
  // kInternode: put the send and receive buffers in GPU memory registered
  // with the NIC (FI_HMEM: GPUDirect RDMA) instead of staging them in pinned
  // host memory. 1: required (create fails when the provider refuses
  // FI_HMEM or the registration), 0: host staging, < 0: MOELINK_GPU_DIRECT,
  // else on for the efa and verbs providers when they accept FI_HMEM.
  int gpu_direct = -1;
  // Time the phases of each call for phase_times() (kInternode records CUDA
  // events around its kernels, which costs a little latency). < 0: read
  // MOELINK_PROFILE.
  int profile = -1;
};

// Where the time of one dispatch or combine went, in microseconds, for the
// backends with a host proxy (kInternode, kInternodeCPU).
struct PhaseTimes {
  double pack_us = 0;    // send half: routes counted, tokens / rows packed
  double post_us = 0;    // proxy: posting writes (and local copies)
  double wire_us = 0;    // proxy: waiting for the peers' data and own completions
  double unpack_us = 0;  // receive half after the proxy finished
};
struct CallTimes {
  PhaseTimes dispatch, combine;
};

namespace detail {
class AllToAllImpl;
}

class AllToAll {
 public:
  // Collective over all ranks of `bootstrap`; allocates and maps the buffers.
  // For kNVLink the current CUDA device is used. Throws InvalidArgument for
  // an invalid config or a config whose rank/world_size disagree with the
  // bootstrap.
  static std::unique_ptr<AllToAll> create(const Config& config, Bootstrap& bootstrap,
                                          const Options& options = {});
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  const Config& config() const;
  Backend backend() const;
  // Bytes of peer-visible memory this rank allocated (dispatch staging,
  // combine receive rows, flags).
  size_t buffer_bytes() const;

  // Inputs (this rank's DP group's tokens; every replica of the group passes
  // the same values):
  //   dp_x        [T, H]  in_dtype (fp8 may be passed as uint8), row contiguous
  //   dp_x_scale  [T, S]  fp32, any strides; undefined when S == 0
  //   indices     [T, k]  int32, uint32 or int64, any strides; -1 (0xffffffff
  //                       for uint32) means "no route"
  //   weights     [T, k]  fp32, any strides
  //   bound_m     [1]     int32, device (host for kCPU): m <= T valid tokens;
  //                       never read by the host
  // Outputs (batched-experts layout):
  //   out_expert_num_tokens [L]        int32, contiguous
  //   out_expert_x          [L, C, H]  in_dtype, row contiguous
  //   out_expert_x_scale    [L, C, S]  fp32, any strides (column-major ok)
  // For local expert j (global id rank * L + j) the count is the number of
  // routes (group g, token t < m_g, slot i) with indices_g[t][i] == that id,
  // each group counted once; rows 0..count-1 hold those tokens in an
  // unspecified order. Rows >= count are not written.
  // do_send / do_recv split the call: issue the send half, run other work on
  // the stream, then the receive half with the same arguments.
  void dispatch(const Tensor& out_expert_num_tokens, const Tensor& out_expert_x,
                const Tensor& out_expert_x_scale, const Tensor& dp_x, const Tensor& dp_x_scale,
                const Tensor& indices, const Tensor& weights, const Tensor& bound_m,
                cudaStream_t stream = nullptr, bool do_send = true, bool do_recv = true);

  //   out_tokens [T, H]     out_dtype, row contiguous
  //   indices, weights, bound_m: as passed to the preceding dispatch
  //   expert_y   [L, C, H]  bf16, fp16 or fp32, row contiguous: expert output
  //                         for each row dispatch wrote
  // Afterwards, on every rank of group g, for t < m:
  //   out_tokens[t] = sum_i weights[t][i] * y(route g, t, i)   (+ out_tokens[t]
  //   when accumulate), summed in fp32. Rows t >= m are left untouched.
  void combine(const Tensor& out_tokens, const Tensor& indices, const Tensor& weights,
               const Tensor& expert_y, const Tensor& bound_m, cudaStream_t stream = nullptr,
               bool do_send = true, bool do_recv = true, bool accumulate = false);

  // Waits for the work issued so far and throws InputError / TimeoutError
  // for anything the device flagged (naming rank, phase, field or peer and
  // the value). Input errors are cleared once reported; a timeout is final.
  void check();

  // Forgets the halves issued since the last complete dispatch + combine:
  // the next call must be a dispatch send again. Only for halves that never
  // ran, i.e. recorded into a CUDA-graph capture that failed and was thrown
  // away; after halves that ran, the peers wait for the rest (and time out).
  void reset_call_order();
  // The phases of the last dispatch and combine (waits for them). All zero
  // unless Options.profile is on and the backend has a proxy.
  CallTimes phase_times();

 private:
  explicit AllToAll(std::unique_ptr<detail::AllToAllImpl> impl);
  std::unique_ptr<detail::AllToAllImpl> impl_;
};

}  // namespace moelink
