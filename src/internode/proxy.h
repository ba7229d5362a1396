// The host proxy of the inter-node all-to-all: one thread per AllToAll that
// runs the protocol of protocol.h over the TransferEngine while the packing
// and unpacking (CPU loops or GPU kernels) happen elsewhere.
//
// The packer and the proxy talk through two words (ProxySignals) that may sit
// in pinned, GPU-mapped host memory: the packer raises `request` to a step
// number when the step's inputs are ready (a release store on the CPU, a
// kernel's system-scope release store on the GPU); the proxy runs the steps
// in order and raises `done`. What the unpacking side reads (ProxyOutput:
// the plan and the `dispatch_ready` / `combine_ready` words) may sit
// elsewhere: pinned host memory, or device memory the proxy writes through a
// GDRCopy mapping. Steps of epoch e (e >= 1):
//   2e-1  dispatch: post routing info + private tokens, gather every peer's,
//         post the rest, wait for the rest to arrive
//   2e    combine: post the output rows (zero bytes to peers without rows),
//         wait for every peer's
// A step always finishes: on a timeout or a failed transfer the proxy records
// the first error (naming the peer) and from then on finishes every step
// without touching the network, so nobody waits forever.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/all_to_all_impl.h"
#include "internode/protocol.h"
#include "internode/route_matrix.h"
#include "moelink/transfer_engine.h"

namespace moelink::detail::internode {

struct ProxySignals {
  uint64_t request;  // written by the packer: the step whose inputs are ready
  uint64_t done;     // written by the proxy: the last step finished
};

// One block the proxy writes and the unpacking side reads:
//   [dispatch_ready, combine_ready][plan: PlanView::words() int64]
// The ready words are set to 1 by the proxy when a dispatch / combine step
// finished, after the plan, and reset to 0 by the consumer. The GPU waits
// for == 1 and writes 0: constants, so the stream operations replay
// unchanged from a CUDA graph.
struct ProxyOutput {
  static constexpr int64_t kPlanOffset = 16;  // bytes before the plan
  static int64_t bytes(const PlanView& v) { return kPlanOffset + 8 * v.words(); }
  char* base;  // as the proxy writes it
  // A write-combined mapping (GDRCopy): stores are fenced so the plan lands
  // before the ready word that announces it.
  bool write_combined = false;
  uint64_t* dispatch_ready() const { return reinterpret_cast<uint64_t*>(base); }
  uint64_t* combine_ready() const { return reinterpret_cast<uint64_t*>(base) + 1; }
  int64_t* plan() const { return reinterpret_cast<int64_t*>(base + kPlanOffset); }
};

inline uint64_t dispatch_step(uint32_t epoch) { return 2ull * epoch - 1; }
inline uint64_t combine_step(uint32_t epoch) { return 2ull * epoch; }

class Proxy {
 public:
  // Copies `rows` runs of `bytes` from recv + offset + i * stride to
  // dst + i * bytes (the peers' routing headers, step 3).
  using RecvReader =
      std::function<void(char* dst, int64_t offset, int64_t stride, int64_t bytes, int rows)>;
  struct Buffers {
    void* send = nullptr;  // Layout::send_bytes, registered with the engine
    void* recv = nullptr;  // Layout::recv_bytes
    fabric::MemoryKind kind = fabric::MemoryKind::kHost;
    int device = 0;
    // This rank's RouteHeader + counts as the packer wrote them, readable
    // by the host. The packer also writes it at the front of every block.
    const char* own_header = nullptr;
    // How the host reads the receive buffer: memcpy when empty (host
    // memory); a device copy for GPU memory.
    RecvReader read_recv;
  };
  // Creates the engine. `spin_polls`: polls of `request` before the idle
  // proxy starts to yield and sleep. `output`: the plan (protocol.h) and
  // ready words the proxy fills for the unpacking side.
  Proxy(const Geometry& g, const Layout& l, const ResolvedOptions& o, ProxySignals* signals,
        ProxyOutput output, int spin_polls);
  // The engine's provider accepted FI_HMEM: buffers may be GPU memory.
  bool engine_hmem() const { return engine_->hmem(); }
  // Collective over the bootstrap: registers the buffers, exchanges
  // descriptors, starts the thread. When registering fails on any rank,
  // every rank throws (naming that rank and what its engine said).
  void start(const Buffers& buffers, Bootstrap& bootstrap);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  const std::string& provider() const { return provider_; }

  // The first error so far (kOk when none) and what the engine said about
  // it. Every proxy error (a timeout, a lost peer, a peer breaking the
  // protocol) is final.
  ErrorRecord error() const;
  std::string error_detail() const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  // Time the last dispatch / combine step spent posting and waiting (post_us
  // and wire_us of PhaseTimes; the rest is the packer's). Read once `done`
  // says the step finished.
  PhaseTimes dispatch_times() const;
  PhaseTimes combine_times() const;

 private:
  void run();
  void run_step(uint64_t step);
  void dispatch(uint32_t epoch);
  void combine(uint32_t epoch);
  void write_plan();
  void store_plan(int word, int64_t v);

  // Waits for imm (kind, peer) once; false (error recorded) on timeout.
  bool wait_peer(ImmKind kind, int peer, Phase phase);
  // A rank some peer reported gone (kAbort), or -1.
  int reported_gone() const;
  std::chrono::steady_clock::duration report_grace() const;
  // Waits for this step's own transfers; false (error recorded) on failure.
  bool wait_transfers(Phase phase);
  void fail(ErrorCode code, Phase phase, int peer, const std::string& detail);
  double remaining_s() const;

  int member(int rank) const { return rank < g_.rank ? rank : rank - 1; }

  Geometry g_;
  Layout l_;
  ResolvedOptions o_;
  Buffers buffers_;
  ProxySignals* signals_;
  ProxyOutput output_;
  int64_t* plan_;
  PlanView plan_view_;
  int spin_polls_;
  std::unique_ptr<fabric::TransferEngine> engine_;
  std::string provider_;
  fabric::MemoryRegion send_mr_{}, recv_mr_{};
  fabric::GroupId peers_ = -1;  // every rank but this one, in rank order
  RouteMatrix matrix_;
  std::vector<fabric::TransferPtr> pending_;  // this step's transfers
  std::vector<int64_t> block_offset_;         // [W] own dispatch blocks in send
  std::vector<char> headers_;                 // [W] peers' RouteHeaders + counts, step 3
  std::chrono::steady_clock::time_point deadline_;
  // This step's time in waits (wait_peer, wait_transfers) and in total.
  class WaitTimer;
  std::chrono::steady_clock::duration waited_{};
  mutable std::mutex times_mu_;
  PhaseTimes dispatch_times_, combine_times_;

  mutable std::mutex error_mu_;
  ErrorRecord error_{};
  std::string error_detail_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace moelink::detail::internode
