// TransferEngine: a host-side RDMA engine over libfabric RDM endpoints, or
// over moelink's own libibverbs transport for ConnectX (provider "ibverbs";
// never run on a NIC yet). One engine per process (per GPU); several NICs
// ("domains"), each driven by a worker thread of its NIC group. See
// docs/transfer_engine.md for the protocol of each operation.
//
// Thread safety: every public member may be called from any thread.
// Completion: operations return a Transfer, which can be waited on, polled,
// or given a callback; the receiving side learns about writes through
// immediate counters (wait_imm) only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moelink/fabric_errors.h"

namespace moelink::fabric {

// EngineOptions::provider that selects moelink's own libibverbs transport
// (one UD QP per NIC for handshakes, two RC QPs per peer) instead of
// libfabric. Not to be confused with libfabric's "verbs" provider
// (verbs;ofi_rxm), which "verbs" still selects. It has only run against a
// fake verbs layer in tests, never on a NIC (docs/transfer_engine.md).
inline constexpr char kVerbsProvider[] = "ibverbs";

struct EngineOptions {
  // libfabric provider: "efa", "efa-direct" (EFA without the provider's
  // RDM protocol layer; libfabric >= 2.1, never run), "shm", "tcp"
  // (tcp;ofi_rxm), "verbs" (verbs;ofi_rxm), or "" for the first of efa,
  // shm, tcp that fi_getinfo offers; or kVerbsProvider ("ibverbs") for
  // moelink's libibverbs transport.
  std::string provider;
  // Number of NICs to use. When the provider offers fewer domains than
  // this (shm, tcp), the same domain is opened several times, which
  // emulates several NICs.
  int num_domains = 1;
  // Domains driven by one worker thread ("NIC group"; 2 = two NICs per GPU).
  int domains_per_worker = 2;
  // Workers sleep briefly when they have had nothing to do for a while,
  // instead of busy polling. Needed on machines with fewer cores than ranks.
  bool yield_when_idle = true;
  // CPU of each worker thread: worker i (NIC group i) runs on CPU
  // worker_cpus[i % size]; empty = not pinned. Every CPU must be one of
  // the machine's and in the process's cpuset (else InvalidArgument). Pin
  // the worker away from the threads that wait on the engine: a waiter
  // polls the same queues.
  std::vector<int> worker_cpus;
  // Every operation fails with TimeoutError when not complete by then.
  double timeout_s = 30.0;
  // Label shown in this engine's address; peers use it in error messages.
  std::string name;
  // Two-sided messages: largest message and receive buffers per domain
  // (ibverbs: per domain and peer). Peers must agree on max_message_bytes.
  size_t max_message_bytes = 4096;
  int recv_buffers = 64;
  // ibverbs only: the device of each domain ("mlx5_0", ...); empty = the
  // machine's devices in ibv_get_device_list order, domain i on device
  // i % count. Port and source GID index are the same for every domain.
  std::vector<std::string> verbs_devices;
  int verbs_port = 1;
  int verbs_gid_index = 0;
};

// An engine's address: its label and the endpoint name of each domain.
// Serializable; exchange it out of band (Bootstrap::all_gather).
struct EngineAddress {
  std::string name;
  // Per domain: raw fi_getname bytes (libfabric), or the NIC's UD contact
  // (LID, GID, UD QPN) and node id (ibverbs).
  std::vector<std::string> endpoints;
  std::vector<char> serialize() const;
  static EngineAddress deserialize(const void* data, size_t size);
  bool operator==(const EngineAddress&) const = default;
};

enum class MemoryKind { kHost, kCuda };

// A local registration. Valid until deregister_memory.
struct MemoryRegion {
  uint64_t id = 0;
  void* ptr = nullptr;
  size_t size = 0;
};

// What a peer needs to write into a registration: the owner's address, the
// remote base (virtual address or 0, per the provider's FI_MR_VIRT_ADDR;
// ibverbs: the virtual address) and key (ibverbs: the rkey) of each domain,
// and the size. Serializable.
struct MemoryDescriptor {
  EngineAddress owner;
  uint64_t size = 0;
  std::vector<uint64_t> remote_base;  // per domain of the owner
  std::vector<uint64_t> keys;         // per domain of the owner
  std::vector<char> serialize() const;
  static MemoryDescriptor deserialize(const void* data, size_t size);
};

using PeerId = int;
using GroupId = int;

// Progress of one operation (a write may be several work requests).
class Transfer {
 public:
  virtual ~Transfer() = default;
  virtual bool done() const = 0;
  // Waits for completion; rethrows the operation's error. timeout_s < 0
  // waits up to the engine's timeout (the operation fails by then).
  virtual void wait(double timeout_s = -1) const = 0;
  // The error, once done (null on success).
  virtual std::exception_ptr error() const = 0;
};
using TransferPtr = std::shared_ptr<Transfer>;
// Called on the worker thread when the operation completes (null on
// success). Keep it short; do not call back into the engine and wait.
using Callback = std::function<void(std::exception_ptr)>;

// Completion by atomic counters instead of a callback: pass
// count_completions(done, failed) as an operation's Callback. The engine
// recognizes it and, without running any callback (so the thread that
// reads the completion, a waiter or the worker, finishes the operation
// itself), adds 1 to `done` when the operation succeeds or to `failed`
// when it fails, after done() turned true (release). Poll the counters, or
// wait on the Transfer. The counters must outlive the operations.
struct CompletionCounters {
  std::atomic<uint64_t>* done = nullptr;
  std::atomic<uint64_t>* failed = nullptr;
  void operator()(std::exception_ptr e) const {  // the plain-callback fallback
    (e ? failed : done)->fetch_add(1, std::memory_order_release);
  }
};
inline Callback count_completions(std::atomic<uint64_t>& done, std::atomic<uint64_t>& failed) {
  return CompletionCounters{&done, &failed};
}

// Paged write (KV cache): page i is page_bytes bytes from
// src_offset + src_pages[i] * src_stride to dst_offset + dst_pages[i] * dst_stride.
struct PagedWrite {
  size_t page_bytes = 0;
  uint64_t src_offset = 0, src_stride = 0;
  uint64_t dst_offset = 0, dst_stride = 0;
  std::vector<uint64_t> src_pages, dst_pages;
};

// One slice of a scatter: len bytes from src_offset of the source to
// dst_offset of group member `member`'s buffer.
struct ScatterSlice {
  size_t member = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  size_t len = 0;
};

struct Message {
  std::vector<char> data;
};

class TransferEngine {
 public:
  // Opens the provider's domains and starts the workers. Throws
  // ProviderUnavailable when the provider is missing, FabricError otherwise.
  static std::unique_ptr<TransferEngine> create(const EngineOptions& options);
  virtual ~TransferEngine() = default;

  virtual const EngineAddress& address() const = 0;
  virtual std::string provider() const = 0;  // as fi_getinfo named it, or "ibverbs"
  virtual int num_domains() const = 0;
  virtual bool hmem() const = 0;  // the provider accepted FI_HMEM

  // ---- memory
  virtual MemoryRegion register_memory(void* ptr, size_t size,
                                       MemoryKind kind = MemoryKind::kHost, int device = 0) = 0;
  virtual void deregister_memory(const MemoryRegion& region) = 0;
  virtual MemoryDescriptor descriptor(const MemoryRegion& region) const = 0;

  // ---- peers
  // Idempotent: the same address gives the same id. Descriptors add their
  // owner implicitly. A peer becomes known unreachable when an operation to
  // it fails with a broken connection or is not complete within the
  // timeout; later operations to it then fail at once with a FabricError
  // naming it and that failure. add_peer of its address clears that: the
  // next operation goes to the provider again (descriptors and
  // add_peer_group do not). A restarted peer has a new address: a new peer.
  virtual PeerId add_peer(const EngineAddress& address) = 0;
  // Members' buffers; the work requests for each member are built once.
  // Members are sharded across domains (member i uses domain i % domains).
  virtual GroupId add_peer_group(const std::vector<MemoryDescriptor>& members) = 0;

  // ---- one-sided writes (the immediate is delivered to the target's
  // immediate counter after the data is in place)
  virtual TransferPtr write(const MemoryRegion& src, uint64_t src_offset,
                            const MemoryDescriptor& dst, uint64_t dst_offset, size_t len,
                            std::optional<uint32_t> imm = std::nullopt, Callback cb = {}) = 0;
  // Every page carries `imm` when given: the target waits for
  // pages.size() counts.
  virtual TransferPtr paged_write(const MemoryRegion& src, const MemoryDescriptor& dst,
                                  const PagedWrite& pages, std::optional<uint32_t> imm = std::nullopt,
                                  Callback cb = {}) = 0;
  // Every slice carries `imm`: member m gets one count per slice for it.
  virtual TransferPtr scatter(GroupId group, const MemoryRegion& src,
                              const std::vector<ScatterSlice>& slices, uint32_t imm,
                              Callback cb = {}) = 0;
  // A zero-byte write with `imm` to every member: each gets one count.
  virtual TransferPtr barrier(GroupId group, uint32_t imm, Callback cb = {}) = 0;

  // ---- immediate counters (this engine as the target)
  // Waits until `imm` has been received `count` times, then consumes them.
  // TimeoutError naming imm, count and what arrived (timeout_s < 0: the
  // engine's timeout).
  virtual void wait_imm(uint32_t imm, uint64_t count, double timeout_s = -1) = 0;
  virtual uint64_t imm_count(uint32_t imm) const = 0;
  // Raises a flag instead of waiting: once `imm` has been received `count`
  // times (arrivals already counted included), consumes them and stores
  // `value` into *flag (an 8-byte aligned word; a release store). The
  // thread that reads the completion stores it (a waiting thread or the
  // worker, so in yield mode up to one idle sleep, 50 us, late when nobody
  // waits). Meant for a GPU kernel polling pinned mapped host memory (or
  // GDRCopy memory) for "the data has arrived" with host staging: the
  // bytes are in place before the immediate is counted. Signals fire in
  // the order they were asked for; do not also wait_imm on the same value.
  // A signal still pending when the engine is destroyed never fires, so
  // the poller needs its own timeout. InvalidArgument for a null or
  // misaligned flag or count 0.
  virtual void signal_on_imm(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value) = 0;

  // ---- two-sided messages (<= max_message_bytes, from a registration)
  virtual TransferPtr send(PeerId peer, const MemoryRegion& src, uint64_t offset, size_t len,
                           Callback cb = {}) = 0;
  // The next received message, in arrival order; nullopt after timeout_s.
  virtual std::optional<Message> recv(double timeout_s) = 0;
};

// fi_version() of the libfabric loaded at run time, e.g. "1.17".
std::string fabric_runtime_version();
// True when fi_getinfo offers the provider with what the engine needs
// ("ibverbs": built with libibverbs and an RDMA device is present).
bool provider_available(const std::string& provider);

}  // namespace moelink::fabric
