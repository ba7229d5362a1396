// The shared dispatch/combine test driver, used by the CPU and the GPU tests.
// It runs on every rank (inside run_ranks), generates inputs that every
// replica of a DP group agrees on, drives AllToAll through a MemoryOps (host
// vectors for kCPU, cudaMalloc'd buffers for kNVLink) and checks each round
// against the reference (reference.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moelink/moelink.h"
#include "reference.h"

namespace moelink_test {

// Where the driver's buffers live and how work is ordered. All copies are
// complete when the call returns.
class MemoryOps {
 public:
  virtual ~MemoryOps() = default;
  virtual void* alloc(size_t bytes) = 0;  // >= 256-byte aligned
  virtual void free(void* p) = 0;
  virtual void h2d(void* dst, const void* src, size_t bytes) = 0;
  virtual void d2h(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill(void* dst, uint8_t byte, size_t bytes) = 0;
  virtual cudaStream_t stream() = 0;
  virtual void sync() = 0;
  // Unrelated work queued between the send and receive halves of a split call.
  virtual void other_work() = 0;
};

// Host memory, no stream: for Backend::kCPU.
std::unique_ptr<MemoryOps> make_host_memory_ops();

enum class Routing {
  kUniform,   // k distinct experts per token, uniformly random
  kSkewed,    // every token's first route goes to one (random) expert
  kWithNone,  // uniform, ~30% of the routes are -1 (some tokens have none)
  kRepeated,  // uniform, with experts repeated within a token's top-k
};
const char* routing_name(Routing r);

enum class Inject {
  kNone,
  kExpertIdE,        // indices of group 0, token 0 holds E (round 1)
  kExpertIdMinus5,   // ... holds -5 (0xfffffffb for uint32)
  kBoundMTooLarge,   // group 0 passes bound_m = T + 5 (round 1)
  kBoundMNegative,   // group 0 passes bound_m = -3 (round 1)
  kExpertOverflow,   // every group routes all k slots of all T tokens to expert 0
                     // (round 1): k * T * G routes for C = T * G rows
};

struct CaseSpec {
  moelink::Backend backend = moelink::Backend::kCPU;
  int world_size = 2;
  int dp_size = 1;
  int64_t max_num_tokens = 32;
  // Rows of the input tensors and out_tokens (<= max_num_tokens; 0: all).
  // m is drawn from [0, input rows] and the backend clamps bound_m to it.
  int64_t input_rows = 0;
  int num_experts = 16;
  int experts_per_token = 2;
  int64_t hidden_dim = 256;
  int hidden_dim_scale = 0;  // set >= 1 for fp8
  moelink::DType in_dtype = moelink::DType::kBFloat16;
  moelink::DType out_dtype = moelink::DType::kBFloat16;
  moelink::DType y_dtype = moelink::DType::kBFloat16;
  moelink::DType index_dtype = moelink::DType::kInt64;
  Routing routing = Routing::kUniform;
  uint64_t seed = 1;
  int rounds = 3;
  bool split = false;       // send half, other work, receive half
  bool accumulate = false;  // combine adds to out_tokens
  // Column-major out_expert_x_scale, transposed (strided) indices/weights and
  // dp_x_scale, uint8 for fp8 tensors.
  bool strided = false;
  // Row-contiguous tensors (dp_x, out_expert_x, expert_y, out_tokens) with
  // padded rows (+16 elements) and experts (+32 elements); the padding must
  // stay untouched.
  bool padded = false;
  // Expert y = x (factor 1); lets a GPU graph compute expert_y with a copy.
  bool identity_expert = false;
  Inject inject = Inject::kNone;
  double timeout_s = 30.0;
  int num_blocks = 0;
  // kInternode / kInternodeCPU: provider ("" = default) and private tokens
  // per (sender, receiver) pair (< 0 = default).
  std::string fabric_provider;
  int max_private_tokens = -1;
  int fabric_nics = 0;   // Options.fabric_nics
  // Options.node_size: 1 (every peer through the engine) unless a case asks
  // for node peers; 0 = by host name (all ranks of a test share one host).
  int node_size = 1;
  int gpu_direct = -1;  // Options.gpu_direct (kInternode)
  bool profile = false;  // Options.profile

  moelink::Config config(int rank) const;
  int64_t rows() const { return input_rows > 0 ? input_rows : max_num_tokens; }
  std::string describe() const;
};

// Inputs of every DP group for one round: deterministic in (seed, round), so
// every rank computes all groups' inputs on its own, and the replicas of a
// group pass identical values.
std::vector<GroupInputs> generate_round_inputs(const CaseSpec& spec, int round);

// A host/device buffer with guard bytes on both sides.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 4096;
  static constexpr uint8_t kGuardByte = 0xA5;
  GuardedBuffer(MemoryOps& ops, size_t bytes);
  ~GuardedBuffer();
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  void* data() const { return static_cast<uint8_t*>(base_) + kGuard; }
  size_t bytes() const { return bytes_; }
  // Empty when both guards are intact, else a description.
  std::string check_guards(const char* name) const;

 private:
  MemoryOps& ops_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// One rank's side of a case: the AllToAll, its buffers and the checks. The
// steps are public so that the GPU tests can capture them into graphs.
class CaseRunner {
 public:
  CaseRunner(const CaseSpec& spec, int rank, moelink::Bootstrap& bootstrap, MemoryOps& ops);
  ~CaseRunner();

  // Generates the round's inputs, writes this group's inputs into the input
  // buffers and poison into every output.
  void prepare_round(int round);
  void dispatch();  // split per spec.split
  void combine();
  // Synchronizes and runs AllToAll::check(), comparing with what the round's
  // injection should raise. `phase` is "dispatch" or "combine".
  void check_errors(const char* phase);
  // Copies the dispatch outputs to the host and checks them.
  void check_dispatch();
  // Builds expert_y from what was dispatched and writes it.
  void write_expert_y();
  void check_combine();
  void check_guards();
  // prepare, dispatch, check, expert_y, combine, check: one whole round.
  void run_round(int round);

  moelink::AllToAll& all_to_all() { return *a2a_; }
  const CaseSpec& spec() const { return spec_; }
  const moelink::Config& config() const { return config_; }
  MemoryOps& ops() { return ops_; }
  GuardedBuffer& out_expert_x() { return *out_x_; }
  GuardedBuffer& expert_y() { return *expert_y_; }
  int round() const { return round_; }

 private:
  void write_inputs();
  void poison_outputs();
  moelink::Tensor dp_x_tensor() const;
  moelink::Tensor dp_x_scale_tensor() const;
  moelink::Tensor indices_tensor() const;
  moelink::Tensor weights_tensor() const;
  moelink::Tensor bound_m_tensor() const;
  moelink::Tensor out_counts_tensor() const;
  moelink::Tensor out_x_tensor() const;
  moelink::Tensor out_scale_tensor() const;
  moelink::Tensor expert_y_tensor() const;
  moelink::Tensor out_tokens_tensor() const;
  ExpertOutputFn reference_y() const;
  bool injects_this_round() const;
  // Elements from one row to the next / one expert to the next in the
  // row-contiguous tensors.
  int64_t pitch() const;
  int64_t expert_pitch() const;

  CaseSpec spec_;
  int rank_;
  moelink::Config config_;
  MemoryOps& ops_;
  std::unique_ptr<moelink::AllToAll> a2a_;
  std::unique_ptr<GuardedBuffer> x_, x_scale_, indices_, weights_, bound_m_;
  std::unique_ptr<GuardedBuffer> out_counts_, out_x_, out_scale_, expert_y_, out_tokens_;
  int round_ = -1;
  std::unique_ptr<Reference> ref_;
  DispatchResult dispatched_;
  std::vector<uint8_t> out_before_;
};

// Runs spec.rounds rounds of dispatch + combine on this rank and checks them.
void run_case_on_rank(const CaseSpec& spec, int rank, moelink::Bootstrap& bootstrap,
                      MemoryOps& ops);

// All ranks run one good round, then `exiting_rank` returns (right away, or
// after the next dispatch when `exit_before_combine`); the others go on, and
// check() must throw TimeoutError naming the exiting rank within
// spec.timeout_s (plus slack), and keep throwing it (a timeout is final).
void run_rank_exit_case(const CaseSpec& spec, int rank, int exiting_rank,
                        moelink::Bootstrap& bootstrap, MemoryOps& ops,
                        bool exit_before_combine = false);

}  // namespace moelink_test
