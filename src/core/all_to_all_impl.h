// The interface every backend implements. The public AllToAll validates
// arguments and call order, then forwards to one of these.
#pragma once

#include <memory>
#include <string>

#include "core/layout.h"
#include "moelink/all_to_all.h"

namespace moelink::detail {

struct DispatchArgs {
  Tensor out_expert_num_tokens, out_expert_x, out_expert_x_scale;
  Tensor dp_x, dp_x_scale, indices, weights, bound_m;
  // Rows the input tensors have (<= max_num_tokens): m is clamped to it.
  int64_t input_rows = 0;
  cudaStream_t stream = nullptr;
};

struct CombineArgs {
  Tensor out_tokens, indices, weights, expert_y, bound_m;
  int64_t input_rows = 0;
  cudaStream_t stream = nullptr;
  bool accumulate = false;
};

// Options with environment defaults applied.
struct ResolvedOptions {
  Backend backend;
  int num_blocks;
  double timeout_s;
  bool debug;
  std::string fabric_provider;  // may still be "" (engine picks)
  int max_private_tokens;       // default applied by AllToAll::create (needs the config)
  int fabric_nics;              // >= 1
  int node_size;                // 0: by host name (resolved collectively by the backend)
  int gpu_direct;               // -1 auto, 0 off, 1 required
  bool profile;
};
ResolvedOptions resolve_options(const Options& o);

class AllToAllImpl {
 public:
  AllToAllImpl(const Config& config, const ResolvedOptions& options);
  virtual ~AllToAllImpl() = default;

  const Config& config() const { return config_; }
  const Geometry& geometry() const { return geometry_; }
  const ResolvedOptions& options() const { return options_; }

  virtual Backend backend() const = 0;
  virtual size_t buffer_bytes() const = 0;
  // The send half, the receive half, or both (at least one is true).
  // Backends may fuse the two halves when both are asked for.
  virtual void dispatch(const DispatchArgs& a, bool send, bool recv) = 0;
  virtual void combine(const CombineArgs& a, bool send, bool recv) = 0;
  // Waits for the work issued so far, returns the error record and clears it
  // unless it is a timeout (which leaves the peers out of step for good).
  virtual ErrorRecord wait_and_take_error() = 0;
  // More about the last error taken, when the backend knows more than the
  // record holds (e.g. what the transfer engine said). May be empty.
  virtual std::string error_detail() const { return {}; }
  // See AllToAll::phase_times.
  virtual CallTimes phase_times() { return {}; }

  // Host-side call-order state (0 dispatch send, 1 dispatch recv, 2 combine
  // send, 3 combine recv), kept by the public AllToAll.
  int next_step = 0;

 protected:
  Config config_;
  Geometry geometry_;
  ResolvedOptions options_;
};

std::unique_ptr<AllToAllImpl> make_cpu_impl(const Config& c, const ResolvedOptions& o,
                                            Bootstrap& bootstrap);
// Each throws InvalidArgument when moelink was built without what the
// backend needs (CUDA, NVSHMEM, libfabric).
std::unique_ptr<AllToAllImpl> make_nvlink_impl(const Config& c, const ResolvedOptions& o,
                                               Bootstrap& bootstrap);
std::unique_ptr<AllToAllImpl> make_nvshmem_impl(const Config& c, const ResolvedOptions& o,
                                                Bootstrap& bootstrap);
// kInternode and kInternodeCPU.
std::unique_ptr<AllToAllImpl> make_internode_impl(const Config& c, const ResolvedOptions& o,
                                                  Bootstrap& bootstrap);

// Throws InputError / TimeoutError describing `e` (no-op for kOk).
void throw_if_error(const ErrorRecord& e, const Config& c, const std::string& detail = {});

}  // namespace moelink::detail
