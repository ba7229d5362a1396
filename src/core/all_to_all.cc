// The public AllToAll: argument checks, call order, debug checks; the data
// movement itself lives in the backends.
#include "moelink/all_to_all.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>

#include "core/all_to_all_impl.h"
#include "core/arg_checks.h"
#include "moelink/errors.h"

namespace moelink {
namespace detail {

namespace {

void check_inputs_rows(const char* call, const char* field, int64_t rows, int64_t max) {
  if (rows < 1 || rows > max)
    bad(call, field,
        "has " + std::to_string(rows) + " rows, expected 1.." + std::to_string(max) +
            " (max_num_tokens)");
}

void check_bound_m(const char* call, const Tensor& t) {
  if (!t.defined()) bad(call, "bound_m", "is missing (null data pointer)");
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  if (n != 1 || t.dtype != DType::kInt32)
    bad(call, "bound_m",
        "must be a one-element int32 tensor, got dtype " + std::string(dtype_name(t.dtype)) +
            " shape " + shape_str(t));
}

// indices, weights and bound_m, the routing both calls take; returns the
// rows indices and weights have.
int64_t check_routing(const char* call, const Config& c, const Tensor& indices,
                      const Tensor& weights, const Tensor& bound_m) {
  const int64_t T = c.max_num_tokens;
  const int k = c.experts_per_token;
  const int64_t ri = check_tensor(call, "indices", indices,
                                  {DType::kInt32, DType::kUInt32, DType::kInt64}, {k}, false);
  check_inputs_rows(call, "indices", ri, T);
  const int64_t rw = check_tensor(call, "weights", weights, {DType::kFloat32}, {k}, false);
  check_inputs_rows(call, "weights", rw, T);
  check_bound_m(call, bound_m);
  return std::min(ri, rw);
}

}  // namespace

ResolvedOptions resolve_options(const Options& o) {
  ResolvedOptions r;
  r.backend = o.backend;
  if (o.num_blocks < 0 || o.num_blocks > 1024)
    throw InvalidArgument("moelink: Options.num_blocks = " + std::to_string(o.num_blocks) +
                          " must be in [0, 1024] (0 = default)");
  r.num_blocks = o.num_blocks;
  r.timeout_s = o.timeout_s > 0 ? o.timeout_s : env_double("MOELINK_TIMEOUT_S", 30.0);
  r.debug = o.debug >= 0 ? o.debug != 0 : env_flag("MOELINK_DEBUG");
  r.fabric_provider = o.fabric_provider;
  if (r.fabric_provider.empty()) {
    const char* p = std::getenv("MOELINK_FABRIC_PROVIDER");
    if (p != nullptr) r.fabric_provider = p;
  }
  // Checked against max_num_tokens, and defaulted, by AllToAll::create.
  r.max_private_tokens = o.max_private_tokens;
  if (o.fabric_nics < 0 || o.fabric_nics > 64)
    throw InvalidArgument("moelink: Options.fabric_nics = " + std::to_string(o.fabric_nics) +
                          " must be in [0, 64] (0 = MOELINK_FABRIC_NICS, else 1)");
  r.fabric_nics = o.fabric_nics > 0 ? o.fabric_nics : env_int("MOELINK_FABRIC_NICS", 1, 1, 64);
  r.profile = o.profile >= 0 ? o.profile != 0 : env_flag("MOELINK_PROFILE");
  // Checked against the config by the inter-node backends, which resolve 0
  // (host names) collectively.
  if (o.node_size > (1 << 24))
    throw InvalidArgument("moelink: Options.node_size = " + std::to_string(o.node_size) +
                          " must be in [0, 16777216] (0 = by host name, < 0 = MOELINK_NODE_SIZE)");
  r.node_size = o.node_size >= 0 ? o.node_size : env_int("MOELINK_NODE_SIZE", 0, 0, 1 << 24);
  if (o.gpu_direct > 1)
    throw InvalidArgument("moelink: Options.gpu_direct = " + std::to_string(o.gpu_direct) +
                          " must be 1 (required), 0 (host staging) or < 0 (MOELINK_GPU_DIRECT, "
                          "else by provider)");
  r.gpu_direct = o.gpu_direct >= 0 ? o.gpu_direct : env_int("MOELINK_GPU_DIRECT", -1, -1, 1);
  return r;
}

AllToAllImpl::AllToAllImpl(const Config& config, const ResolvedOptions& options)
    : config_(config), options_(options) {
  geometry_ = make_geometry(config.rank, config.world_size, config.dp_size, config.num_experts,
                            config.experts_per_token, config.max_num_tokens, config.hidden_dim,
                            config.hidden_dim_scale,
                            static_cast<int>(dtype_size(config.in_dtype)),
                            static_cast<int>(dtype_size(config.out_dtype)));
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kDispatchSend: return "dispatch_send";
    case Phase::kDispatchRecv: return "dispatch_recv";
    case Phase::kCombineSend: return "combine_send";
    case Phase::kCombineRecv: return "combine_recv";
  }
  return "unknown phase";
}

void throw_if_error(const ErrorRecord& e, const Config& c, const std::string& detail) {
  auto code = static_cast<ErrorCode>(e.code);
  if (code == ErrorCode::kOk) return;
  std::ostringstream os;
  os << "moelink: rank " << c.rank << ", " << phase_name(static_cast<Phase>(e.phase)) << ": ";
  switch (code) {
    case ErrorCode::kBadExpertId:
      os << "indices[" << e.extra / c.experts_per_token << "][" << e.extra % c.experts_per_token
         << "] holds expert id " << e.value
         << ", outside [0, num_experts = " << c.num_experts
         << ") and not -1; the route was dropped";
      throw InputError(os.str());
    case ErrorCode::kBoundMTooLarge:
      os << "bound_m = " << e.value << " is outside [0, " << e.extra
         << "] (max_num_tokens or the rows of the inputs); it was clamped";
      throw InputError(os.str());
    case ErrorCode::kExpertOverflow:
      os << "local expert " << e.value << " received more routes than its " << e.extra
         << " rows (max_num_tokens * num_dp_groups; an expert repeated within a token's "
            "top-k counts twice); the excess routes were dropped";
      throw InputError(os.str());
    case ErrorCode::kTimeout:
      os << "timed out after " << e.value << " s waiting for rank " << e.peer
         << " (dead, stalled, or not calling the same sequence of dispatch/combine); "
            "this AllToAll is unusable now";
      if (!detail.empty()) os << " [" << detail << "]";
      throw TimeoutError(os.str());
    case ErrorCode::kPeerLost:
      os << "lost contact with ";
      if (e.peer >= 0)
        os << "rank " << e.peer;
      else
        os << "a peer";
      os << " (a transfer failed or a peer broke the protocol: " << detail
         << "); this AllToAll is unusable now";
      throw TimeoutError(os.str());
    default:
      os << "unknown error code " << e.code;
      throw Error(os.str());
  }
}

}  // namespace detail

namespace {

// The argument-check helpers above live in detail's anonymous namespace
// (core/arg_checks.h for the shared ones).
using detail::bad;
using detail::check_routing;
using detail::check_inputs_rows;
using detail::check_tensor;
using detail::shape_str;

// The order the halves must come in; anything else is a host-side error.
const char* step_name(int s) {
  switch (s) {
    case 0: return "dispatch send half";
    case 1: return "dispatch receive half";
    case 2: return "combine send half";
    default: return "combine receive half";
  }
}

void expect_step(detail::AllToAllImpl& impl, int want) {
  if (impl.next_step != want)
    throw InvalidArgument(std::string("moelink: call order: the ") + step_name(want) +
                          " was called, but the next step must be the " +
                          step_name(impl.next_step) +
                          " (calls alternate dispatch, combine; each send half comes before "
                          "its receive half)");
  impl.next_step = (want + 1) % 4;
}

}  // namespace

AllToAll::AllToAll(std::unique_ptr<detail::AllToAllImpl> impl) : impl_(std::move(impl)) {}
AllToAll::~AllToAll() = default;

std::unique_ptr<AllToAll> AllToAll::create(const Config& config, Bootstrap& bootstrap,
                                           const Options& options) {
  config.validate();
  if (config.rank != bootstrap.rank() || config.world_size != bootstrap.world_size())
    throw InvalidArgument("moelink: config rank/world_size = " + std::to_string(config.rank) +
                          "/" + std::to_string(config.world_size) +
                          " disagree with the bootstrap's " + std::to_string(bootstrap.rank()) +
                          "/" + std::to_string(bootstrap.world_size()));
  auto resolved = detail::resolve_options(options);
  if (resolved.max_private_tokens > config.max_num_tokens)
    throw InvalidArgument("moelink: Options.max_private_tokens = " +
                          std::to_string(resolved.max_private_tokens) + " must be in [0, " +
                          std::to_string(config.max_num_tokens) +
                          "] (max_num_tokens; < 0 = default)");
  // The default needs the config: min(max_num_tokens, 32).
  if (resolved.max_private_tokens < 0)
    resolved.max_private_tokens = static_cast<int>(std::min<int64_t>(config.max_num_tokens, 32));
  std::unique_ptr<detail::AllToAllImpl> impl;
  switch (resolved.backend) {
    case Backend::kCPU: impl = detail::make_cpu_impl(config, resolved, bootstrap); break;
    case Backend::kNVLink: impl = detail::make_nvlink_impl(config, resolved, bootstrap); break;
    case Backend::kNVSHMEM: impl = detail::make_nvshmem_impl(config, resolved, bootstrap); break;
    case Backend::kInternode:
    case Backend::kInternodeCPU:
      impl = detail::make_internode_impl(config, resolved, bootstrap);
      break;
    default:
      throw InvalidArgument("moelink: Options.backend = " +
                            std::to_string(static_cast<int>(resolved.backend)) +
                            " is not a moelink::Backend");
  }
  return std::unique_ptr<AllToAll>(new AllToAll(std::move(impl)));
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kNVLink: return "nvlink";
    case Backend::kCPU: return "cpu";
    case Backend::kNVSHMEM: return "nvshmem";
    case Backend::kInternode: return "internode";
    case Backend::kInternodeCPU: return "internode-cpu";
  }
  return "unknown";
}

const Config& AllToAll::config() const { return impl_->config(); }
Backend AllToAll::backend() const { return impl_->backend(); }
size_t AllToAll::buffer_bytes() const { return impl_->buffer_bytes(); }

void AllToAll::dispatch(const Tensor& out_expert_num_tokens, const Tensor& out_expert_x,
                        const Tensor& out_expert_x_scale, const Tensor& dp_x,
                        const Tensor& dp_x_scale, const Tensor& indices, const Tensor& weights,
                        const Tensor& bound_m, cudaStream_t stream, bool do_send, bool do_recv) {
  const Config& c = impl_->config();
  const char* call = "dispatch";
  if (!do_send && !do_recv)
    throw InvalidArgument("moelink: dispatch: do_send and do_recv are both false: nothing to do");
  const int64_t T = c.max_num_tokens, H = c.hidden_dim, S = c.hidden_dim_scale;
  const int L = c.num_local_experts();
  const int64_t C = c.expert_capacity();
  // Named lists: the array behind an initializer_list temporary would die at
  // the end of the full expression, leaving x_types dangling.
  const std::initializer_list<DType> fp8_types{DType::kFloat8E4M3, DType::kUInt8};
  const std::initializer_list<DType> in_types{c.in_dtype};
  const auto x_types = c.in_dtype == DType::kFloat8E4M3 ? fp8_types : in_types;
  detail::DispatchArgs a;
  a.stream = stream;
  int64_t rows = check_tensor(call, "dp_x", dp_x, x_types, {H}, true);
  check_inputs_rows(call, "dp_x", rows, T);
  if (S > 0) {
    int64_t r = check_tensor(call, "dp_x_scale", dp_x_scale, {DType::kFloat32}, {S}, false);
    check_inputs_rows(call, "dp_x_scale", r, T);
    rows = std::min(rows, r);
  }
  const int64_t routing_rows = check_routing(call, c, indices, weights, bound_m);
  if (check_tensor(call, "out_expert_num_tokens", out_expert_num_tokens, {DType::kInt32}, {},
                   false) != L || out_expert_num_tokens.stride[0] != 1)
    bad(call, "out_expert_num_tokens",
        "must be a contiguous int32 tensor of shape [" + std::to_string(L) +
            "] (num_local_experts)");
  if (check_tensor(call, "out_expert_x", out_expert_x, x_types, {C, H}, true) != L)
    bad(call, "out_expert_x", "has shape " + shape_str(out_expert_x) + ", expected [" +
                                  std::to_string(L) + ", " + std::to_string(C) + ", " +
                                  std::to_string(H) + "]");
  if (S > 0 && check_tensor(call, "out_expert_x_scale", out_expert_x_scale, {DType::kFloat32},
                            {C, S}, false) != L)
    bad(call, "out_expert_x_scale", "has shape " + shape_str(out_expert_x_scale) +
                                        ", expected [" + std::to_string(L) + ", " +
                                        std::to_string(C) + ", " + std::to_string(S) + "]");
  a.out_expert_num_tokens = out_expert_num_tokens;
  a.out_expert_x = out_expert_x;
  a.out_expert_x_scale = S > 0 ? out_expert_x_scale : Tensor{};
  a.dp_x = dp_x;
  a.dp_x_scale = S > 0 ? dp_x_scale : Tensor{};
  a.indices = indices;
  a.weights = weights;
  a.bound_m = bound_m;
  a.input_rows = std::min(rows, routing_rows);
  const int step = impl_->next_step;
  if (do_send) expect_step(*impl_, 0);
  if (do_recv) expect_step(*impl_, 1);
  try {
    impl_->dispatch(a, do_send, do_recv);
  } catch (...) {
    impl_->next_step = step;  // a refused call did not happen
    throw;
  }
  if (impl_->options().debug) check();
}

void AllToAll::combine(const Tensor& out_tokens, const Tensor& indices, const Tensor& weights,
                       const Tensor& expert_y, const Tensor& bound_m, cudaStream_t stream,
                       bool do_send, bool do_recv, bool accumulate) {
  const Config& c = impl_->config();
  const char* call = "combine";
  if (!do_send && !do_recv)
    throw InvalidArgument("moelink: combine: do_send and do_recv are both false: nothing to do");
  const int64_t T = c.max_num_tokens, H = c.hidden_dim, C = c.expert_capacity();
  const int L = c.num_local_experts();
  detail::CombineArgs a;
  a.stream = stream;
  a.accumulate = accumulate;
  int64_t ro = check_tensor(call, "out_tokens", out_tokens, {c.out_dtype}, {H}, true);
  check_inputs_rows(call, "out_tokens", ro, T);
  const int64_t routing_rows = check_routing(call, c, indices, weights, bound_m);
  if (check_tensor(call, "expert_y", expert_y,
                   {DType::kBFloat16, DType::kFloat16, DType::kFloat32}, {C, H}, true) != L)
    bad(call, "expert_y", "has shape " + shape_str(expert_y) + ", expected [" +
                              std::to_string(L) + ", " + std::to_string(C) + ", " +
                              std::to_string(H) + "]");
  a.out_tokens = out_tokens;
  a.indices = indices;
  a.weights = weights;
  a.expert_y = expert_y;
  a.bound_m = bound_m;
  a.input_rows = std::min(ro, routing_rows);
  const int step = impl_->next_step;
  if (do_send) expect_step(*impl_, 2);
  if (do_recv) expect_step(*impl_, 3);
  try {
    impl_->combine(a, do_send, do_recv);
  } catch (...) {
    impl_->next_step = step;
    throw;
  }
  if (impl_->options().debug) check();
}

void AllToAll::reset_call_order() { impl_->next_step = 0; }

CallTimes AllToAll::phase_times() { return impl_->phase_times(); }

void AllToAll::check() {
  const detail::ErrorRecord e = impl_->wait_and_take_error();
  detail::throw_if_error(e, impl_->config(), impl_->error_detail());
}

}  // namespace moelink
