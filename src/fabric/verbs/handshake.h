// RC connection setup over the UD QP, as an explicit per-peer state machine
// (issue 3: "one UD QP per NIC for addressing and handshakes, then two RC
// QPs per peer"). Transport-free: messages leave through the `send` hook
// (UdChannel in production, a lossy test wire in the tests) and come in
// through on_message(); time only advances through tick(now). QPs are made
// through the Device interface, so the fake layer can stand in.
//
// Per peer:
//   connect(): create both RC QPs (-> INIT), send HELLO     => kHelloSent
//   expect():  passive, nothing sent                         => kExpecting
//   HELLO in:  record the peer's QPs, RTR+RTS ours, send ACK
//              kHelloSent -> kRtsAwaitAck (simultaneous open; still needs
//              an ACK of our HELLO), kExpecting -> kConnected
//              (creating the QPs now); later HELLOs are re-ACKed.
//   ACK in:    (echoing our session) record + RTR/RTS if not yet => kConnected
//   tick():    resend HELLO every retry_interval until max_attempts, then
//              kFailed with a TimeoutError naming the peer; a passive peer
//              fails when no HELLO came within passive_timeout.
// Simultaneous open needs no tie-break: each side has exactly one QP pair
// per peer and both HELLO and ACK carry it, so both sides end connected to
// each other's only pair whatever the order of arrival.
// Ignored (counted in stats()): malformed datagrams, messages for another
// node, from unknown nodes (unless accept_unknown_peers: then a HELLO from
// one makes it a passive peer, as if expect() had been called), ACKs echoing
// another session (a late ACK to a
// previous incarnation), anything for a failed peer, duplicates. A HELLO/ACK
// carrying a new session for a known peer (it restarted) or different QPs
// under the same session fails that peer: reconnection is not implemented.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "fabric/verbs/handshake_msg.h"
#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs {

using Clock = std::chrono::steady_clock;

struct HandshakeOptions {
  std::chrono::milliseconds retry_interval{200};
  int max_attempts = 10;  // HELLOs sent before giving up
  std::chrono::milliseconds passive_timeout{5000};
  QpCaps msg_caps{64, 64, 1, 1, 64};      // SEND/RECV QP
  QpCaps write_caps{256, 256, 1, 1, 64};  // WRITE_WITH_IMM QP
  // A HELLO from a node never connect()ed or expect()ed is answered (the
  // peer is added passively, named "node <id>") instead of ignored: the
  // engine's targets need not know their writers in advance.
  bool accept_unknown_peers = false;
};

// What this node advertises.
struct LocalNode {
  uint64_t id = 0;
  uint64_t session = 0;  // non-zero, new per process start
  UdContact ud;
  RemoteBuffer region;  // rkey info sent to every peer (may be empty)
};

enum class PeerState { kExpecting, kHelloSent, kRtsAwaitAck, kConnected, kFailed };
const char* to_string(PeerState s);

// One peer's RC pair, as the data path will use it.
struct PeerConnection {
  std::string name;
  uint64_t node = 0;
  PeerState state = PeerState::kExpecting;
  std::unique_ptr<Qp> msg_qp, write_qp;
  QpEnd local_msg, local_write;   // our QPNs and send PSNs
  QpEnd remote_msg, remote_write; // valid once remote_known
  bool remote_known = false;
  uint64_t remote_session = 0;
  UdContact remote_ud;
  RemoteBuffer remote_region;
  int hellos_sent = 0;
  Clock::time_point started{}, deadline{};
  std::exception_ptr error;
};

struct HandshakeStats {
  uint64_t malformed = 0, misdirected = 0, unknown_peer = 0, stale = 0, late = 0,
           duplicate = 0, unexpected = 0, hellos_sent = 0, acks_sent = 0;
};

class Handshake {
 public:
  using SendFn = std::function<void(const UdContact& to, const HandshakeMsg& msg)>;
  // Called once per peer right after its two RC QPs reached INIT, before
  // any HELLO or ACK naming them is sent and before RTR: where receives are
  // posted, so that nothing the peer sends once connected finds an empty
  // receive queue. A throw fails the peer like a QP creation failure.
  using QpsCreatedFn = std::function<void(uint64_t node, Qp& msg_qp, Qp& write_qp)>;

  // cq: completion queue for both RC QPs of every peer (send and receive).
  // The Handshake owns the peers' QPs: destroy it before cq and device.
  Handshake(Device& device, Cq& cq, const LocalNode& local, HandshakeOptions options,
            SendFn send);

  void on_qps_created(QpsCreatedFn fn) { qps_created_ = std::move(fn); }

  // Active side: the peer's UD contact came out of band. Idempotent (a
  // second call only renames the peer, e.g. one accepted as "node <id>").
  void connect(uint64_t node, const std::string& name, const UdContact& contact,
               Clock::time_point now);
  // Passive side: wait for the peer's HELLO.
  void expect(uint64_t node, const std::string& name, Clock::time_point now);

  void on_datagram(std::span<const uint8_t> bytes, Clock::time_point now);
  void on_message(const HandshakeMsg& msg, Clock::time_point now);
  void tick(Clock::time_point now);

  // Throws InvalidArgument for a node never added.
  const PeerConnection& peer(uint64_t node) const;
  // Rethrows the peer's error; true once connected.
  bool ready(uint64_t node) const;
  bool all_settled() const;  // every peer connected or failed
  const HandshakeStats& stats() const { return stats_; }

 private:
  PeerConnection& add(uint64_t node, const std::string& name, PeerState state,
                      Clock::time_point now);
  void create_qps(PeerConnection& p);
  void send_msg(PeerConnection& p, MsgType type, Clock::time_point now);
  // Records the remote QPs and brings ours to RTS; false (peer failed) on a
  // conflict with what was recorded before.
  bool learn_remote(PeerConnection& p, const HandshakeMsg& m);
  void fail(PeerConnection& p, std::exception_ptr e);
  std::string who(const PeerConnection& p) const;

  Device& device_;
  Cq& cq_;
  LocalNode local_;
  HandshakeOptions options_;
  SendFn send_;
  QpsCreatedFn qps_created_;
  std::mt19937 psn_rng_;
  std::map<uint64_t, PeerConnection> peers_;
  HandshakeStats stats_;
};

}  // namespace moelink::fabric::verbs
