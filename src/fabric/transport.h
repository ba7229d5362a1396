// The per-NIC transport interface of the TransferEngine. The engine and its
// workers (worker.h) see NICs only through `Nic`; two implementations:
//  * Domain (fabric_domain.h): one libfabric domain with one RDM endpoint;
//  * verbs::VerbsNic (verbs/verbs_nic.h): one ibverbs device port with a UD
//    QP for handshakes and two RC QPs per peer.
//
// Threading: after construction a Nic is only called under its worker's
// endpoint lock (worker.h), so implementations need no locking of their own.
// Hot path: post() and poll() are called once per work request / poll pass
// (one virtual call each) and must not allocate once warm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moelink/transfer_engine.h"

namespace moelink::fabric {

// The head of every in-flight work request's context. A transport may use
// transport_space until the work request's completion (libfabric keeps its
// fi_context2 there); a completion hands the same pointer back to the
// worker, whose contexts derive from this struct.
struct WrContext {
  alignas(16) unsigned char transport_space[64];
};

// One work request as the worker hands it to a transport.
struct Wr {
  enum class Kind : uint8_t { kWrite, kSend };
  Kind kind = Kind::kWrite;
  bool has_imm = false;  // writes: deliver `imm` to the target's counters
  uint32_t imm = 0;
  uint64_t dest = 0;     // Nic::insert_peer's handle
  void* buf = nullptr;   // local source (null for zero-byte writes)
  size_t len = 0;
  void* desc = nullptr;  // MemoryHandle::desc of the registration holding buf
  uint64_t remote_addr = 0;  // writes: target address (remote base + offset)
  uint64_t remote_key = 0;   // writes: target key
};

// One registration on one NIC.
struct MemoryHandle {
  void* impl = nullptr;      // the transport's registration object
  void* desc = nullptr;      // what work requests from this memory carry (Wr::desc)
  uint64_t key = 0;          // remote key, published in MemoryDescriptor::keys
  uint64_t remote_base = 0;  // remote address of byte 0 (MemoryDescriptor::remote_base)
};

enum class PostStatus {
  kPosted,  // accepted; its completion comes through poll()
  kAgain,   // not now (queue full, peer still connecting): retry later
  kFailed,  // never: PostError says why
};

struct PostError {
  bool timeout = false;  // the engine reports TimeoutError instead of FabricError
  std::string text;      // names the peer where the transport knows it
};

// What poll() found, one call per event. Called from inside poll(): the
// message bytes are valid only during message_arrived (the receive buffer is
// reposted right after).
class CompletionSink {
 public:
  virtual void wr_done(WrContext* ctx) = 0;
  // peer_unreachable: the error says the peer cannot be reached any more
  // (its connection refused, reset or gone), not that this request was
  // wrong; the engine then fails later work to the peer at once.
  virtual void wr_failed(WrContext* ctx, const std::string& why, bool peer_unreachable) = 0;
  virtual void imm_arrived(uint32_t imm) = 0;
  virtual void message_arrived(const char* data, size_t len) = 0;

 protected:
  ~CompletionSink() = default;
};

// Receive buffers for two-sided messages, per NIC (libfabric: shared by all
// peers) or per peer (verbs: one set per message QP).
struct ReceiveConfig {
  size_t max_message_bytes = 4096;
  int recv_buffers = 64;
};

class Nic {
 public:
  virtual ~Nic() = default;

  // Domain index in the engine: not virtual, the hot path asks it several
  // times per work request.
  int index() const { return index_; }
  virtual const std::string& provider() const = 0;  // "tcp;ofi_rxm", "ibverbs", ...
  virtual const std::string& endpoint() const = 0;  // bytes for EngineAddress::endpoints
  virtual bool hmem() const = 0;                    // CUDA memory can be registered

  // ---- memory (setup path; FabricError on failure)
  virtual MemoryHandle register_memory(void* ptr, size_t size, MemoryKind kind, int device) = 0;
  virtual void deregister_memory(const MemoryHandle& mr) = 0;

  // ---- peers (setup path): a handle for Wr::dest from a peer's endpoint
  // bytes (EngineAddress::endpoints[i]); peer_name is for error messages.
  // Idempotent per endpoint for verbs; libfabric inserts again.
  virtual uint64_t insert_peer(const std::string& endpoint, const std::string& peer_name) = 0;

  // ---- data path
  // `more`: the caller's next post goes to the same destination, so a
  // transport may hold this one back and ring one doorbell for several
  // (verbs WR chaining); it then posts at the first post without `more`, a
  // post to another destination, or flush(). A transport that batches takes
  // the queue slot at once, so kPosted stays true; a doorbell that fails
  // later reports its work requests through wr_failed.
  virtual PostStatus post(const Wr& wr, WrContext* ctx, bool more, PostError* error) = 0;
  virtual void flush() = 0;
  // Reads what completed (non-blocking), also drives the transport's own
  // progress (verbs: handshakes). Returns how many events it handled.
  virtual int poll(CompletionSink& sink) = 0;

  // ---- teardown: no completion arrives afterwards; outstanding work
  // requests are abandoned (their contexts stay the worker's to free).
  virtual void close_endpoint() = 0;

 protected:
  explicit Nic(int index) : index_(index) {}
  const int index_;
};

}  // namespace moelink::fabric
