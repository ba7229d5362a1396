// The verbs transport of the TransferEngine: one ibverbs device port as a
// `Nic` (fabric/transport.h), written against the thin Device/Qp/Cq layer
// (qp.h) so the fake layer can drive it in tests.
//
//  * One UD channel (ud_channel.h) per NIC carries the RC handshake
//    (handshake.h); the NIC's endpoint bytes (verbs_address.h) are its UD
//    contact and node id. Peers are connected from add_peer: insert_peer
//    starts the handshake and returns at once; posts to the peer answer
//    kAgain until it is connected (the worker retries, holding back only
//    that destination) and kFailed with the handshake's TimeoutError text
//    when it gives up, shortly before the engine timeout. HELLOs from nodes
//    never added are answered (targets need not add their writers).
//  * Per peer two RC QPs: the message QP (SEND/RECV into recv_buffers slots
//    of max_message_bytes, copied out and reposted) and the write QP
//    (RDMA_WRITE[_WITH_IMM]; write_recv_depth sge-less receives that only
//    carry immediates, reposted one by one). Receives are posted when the
//    QPs are created, before the peer can know them.
//  * Writes to one peer posted with `more` are chained (WriteChain) into one
//    ibv_post_send of up to max_chain WRs, only the last signaled; every WR
//    holds its send-queue slot (SendRing) until a completion retires it.
//  * Completions: wr_id (wr_id.h) says peer, QP and sequence number or slot.
//    wc.imm_data is big-endian on the wire (imm_from_wire). An error
//    completion fails its WR with the status and the peer's name, retires
//    the ones before it as done (RC completes in order), and marks the peer
//    broken: its QPs are in error and reconnection is not implemented, so
//    later posts to it fail at once naming the first error.
//
// COMPILED AND TESTED ONLY AGAINST THE FAKE LAYER: never run on a NIC.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fabric/transport.h"
#include "fabric/verbs/handshake.h"
#include "fabric/verbs/qp.h"
#include "fabric/verbs/send_ring.h"
#include "fabric/verbs/ud_channel.h"
#include "fabric/verbs/wr_builder.h"

namespace moelink::fabric::verbs {

struct VerbsNicOptions {
  // The engine timeout: the handshake gives up at about 0.8 of it, so its
  // error (naming the peer) reaches the operations before their deadline.
  double timeout_s = 30.0;
  ReceiveConfig rx;
  uint32_t max_chain = 32;          // writes per doorbell
  uint32_t write_send_depth = 256;  // write QP send queue
  uint32_t write_recv_depth = 256;  // immediate receives per peer
  uint32_t msg_send_depth = 64;     // message QP send queue
  uint32_t max_inline = 64;         // requested max_inline_data
  // The RC completion queue shared by all peers: every peer reserves room
  // for all its QPs' entries (640 with the defaults and 64 receive buffers),
  // so 2^18 entries (16 MiB of CQEs) hold about 400 peers.
  int cq_depth = 1 << 18;
  uint32_t ud_slots = 256;          // UD receive and send slots (handshake datagrams)
  uint64_t node_id = 0;             // 0: random
  uint64_t session = 0;             // 0: random
};

class VerbsNic final : public Nic {
 public:
  VerbsNic(std::unique_ptr<Device> device, int index, const VerbsNicOptions& options);
  ~VerbsNic() override;
  VerbsNic(const VerbsNic&) = delete;
  VerbsNic& operator=(const VerbsNic&) = delete;

  const std::string& provider() const override { return provider_; }
  const std::string& endpoint() const override { return endpoint_; }
  bool hmem() const override { return false; }

  MemoryHandle register_memory(void* ptr, size_t size, MemoryKind kind, int device) override;
  void deregister_memory(const MemoryHandle& mr) override;
  uint64_t insert_peer(const std::string& endpoint, const std::string& peer_name) override;

  PostStatus post(const Wr& wr, WrContext* ctx, bool more, PostError* error) override;
  void flush() override;
  int poll(CompletionSink& sink) override;
  void close_endpoint() override;

  // For tests: doorbells rung on write QPs, this NIC's node id, whether a
  // destination is connected (and not broken).
  uint64_t write_doorbells() const { return write_doorbells_; }
  uint64_t node_id() const { return node_id_; }
  bool peer_ready(uint64_t dest) const;

 private:
  struct Peer;
  Peer& peer_of_node(uint64_t node, const std::string& name);
  void on_qps_created(uint64_t node, Qp& msg_qp, Qp& write_qp);
  // UD datagrams, handshake retries and newly connected / failed peers.
  int control_pass(Clock::time_point now);
  PostStatus not_ready(Peer& p, PostError* error);
  PostStatus post_send(Peer& p, const Wr& wr, WrContext* ctx, PostError* error);
  void handle(const ibv_wc& wc, CompletionSink& sink);
  void repost_imm(Peer& p);
  void repost_msg(Peer& p, uint32_t slot);
  // The peer's QPs are unusable from now on; the first reason sticks.
  void break_peer(Peer& p, const std::string& why, bool timeout = false);
  std::string who(const Peer& p) const;

  VerbsNicOptions options_;
  std::string provider_ = "ibverbs";
  uint64_t node_id_ = 0;
  // Destruction order (reverse of declaration): the handshake's QPs, the
  // peers' receive MRs, the UD channel, then the CQ, then the device.
  std::unique_ptr<Device> device_;
  std::unique_ptr<Cq> cq_;
  std::unique_ptr<UdChannel> ud_;
  std::vector<std::unique_ptr<Peer>> peers_;  // index = Wr::dest
  std::unordered_map<uint64_t, uint32_t> peer_by_node_;
  std::unique_ptr<Handshake> handshake_;
  std::string endpoint_;
  int cq_entries_ = 0;  // completion entries the peers' QPs can hold
  int connecting_ = 0;  // peers neither connected nor broken
  Clock::time_point next_control_{};
  // The write chain being built (one peer at a time) and its WRs' ids.
  Peer* chain_peer_ = nullptr;
  std::vector<uint64_t> chain_ids_;
  // Work requests that failed at their doorbell, reported at the next poll.
  std::vector<std::pair<WrContext*, std::string>> failed_;
  std::vector<WrContext*> scratch_;
  ibv_send_wr send_wr_{};
  ibv_sge send_sge_{};
  std::vector<ibv_wc> wcs_;
  uint64_t write_doorbells_ = 0;
  bool closed_ = false;
};

}  // namespace moelink::fabric::verbs
