#include "fabric/verbs/handshake.h"

#include <string>

#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {

const char* to_string(PeerState s) {
  switch (s) {
    case PeerState::kExpecting: return "expecting HELLO";
    case PeerState::kHelloSent: return "HELLO sent";
    case PeerState::kRtsAwaitAck: return "RTS, awaiting ACK";
    case PeerState::kConnected: return "connected";
    case PeerState::kFailed: return "failed";
  }
  return "?";
}

Handshake::Handshake(Device& device, Cq& cq, const LocalNode& local, HandshakeOptions options,
                     SendFn send)
    : device_(device),
      cq_(cq),
      local_(local),
      options_(options),
      send_(std::move(send)),
      // Seeded from the session so PSNs differ across restarts (a stale
      // packet of an old connection must not fall in the new PSN window)
      // yet are reproducible in tests.
      psn_rng_(static_cast<std::mt19937::result_type>(local.session ^ (local.session >> 32))) {
  if (local_.session == 0) throw InvalidArgument("verbs handshake: session must be non-zero");
  if (options_.max_attempts < 1) throw InvalidArgument("verbs handshake: max_attempts < 1");
}

std::string Handshake::who(const PeerConnection& p) const {
  return "verbs handshake with peer '" + p.name + "' (node " + std::to_string(p.node) + ")";
}

PeerConnection& Handshake::add(uint64_t node, const std::string& name, PeerState state,
                               Clock::time_point now) {
  if (node == local_.id) {
    throw InvalidArgument("verbs handshake: peer '" + name + "' has this node's own id " +
                          std::to_string(node));
  }
  PeerConnection& p = peers_[node];
  p.node = node;
  p.name = name;
  p.state = state;
  p.started = now;
  return p;
}

void Handshake::create_qps(PeerConnection& p) {
  QpInit init;
  init.type = QpType::kRc;
  init.send_cq = &cq_;
  init.recv_cq = &cq_;
  init.caps = options_.msg_caps;
  p.msg_qp = device_.create_qp(init);
  init.caps = options_.write_caps;
  p.write_qp = device_.create_qp(init);
  p.msg_qp->to_init();
  p.write_qp->to_init();
  p.local_msg = {p.msg_qp->qpn(), static_cast<uint32_t>(psn_rng_() & 0xffffff)};
  p.local_write = {p.write_qp->qpn(), static_cast<uint32_t>(psn_rng_() & 0xffffff)};
  if (qps_created_) qps_created_(p.node, *p.msg_qp, *p.write_qp);
}

void Handshake::connect(uint64_t node, const std::string& name, const UdContact& contact,
                        Clock::time_point now) {
  if (auto it = peers_.find(node); it != peers_.end()) {
    if (it->second.state != PeerState::kExpecting) {  // already active or done
      if (!name.empty()) it->second.name = name;
      return;
    }
  }
  PeerConnection& p = add(node, name, PeerState::kHelloSent, now);
  p.remote_ud = contact;
  try {
    if (!p.msg_qp) create_qps(p);
  } catch (const Error& e) {
    FabricError named(who(p) + ": " + e.what());
    fail(p, std::make_exception_ptr(named));
    throw named;
  }
  send_msg(p, MsgType::kHello, now);
}

void Handshake::expect(uint64_t node, const std::string& name, Clock::time_point now) {
  if (peers_.count(node)) return;
  add(node, name, PeerState::kExpecting, now);
}

void Handshake::send_msg(PeerConnection& p, MsgType type, Clock::time_point now) {
  HandshakeMsg m;
  m.type = type;
  m.from = local_.id;
  m.to = p.node;
  m.session = local_.session;
  m.echo_session = type == MsgType::kAck ? p.remote_session : 0;
  m.ud = local_.ud;
  m.msg_qp = p.local_msg;
  m.write_qp = p.local_write;
  m.region = local_.region;
  if (type == MsgType::kHello) {
    ++p.hellos_sent;
    ++stats_.hellos_sent;
    p.deadline = now + options_.retry_interval;
  } else {
    ++stats_.acks_sent;
  }
  send_(p.remote_ud, m);
}

bool Handshake::learn_remote(PeerConnection& p, const HandshakeMsg& m) {
  if (p.remote_known) {
    if (m.session != p.remote_session) {
      fail(p, std::make_exception_ptr(FabricError(
                  who(p) + ": the peer restarted (session " + std::to_string(p.remote_session) +
                  ", now " + std::to_string(m.session) + "); reconnection is not implemented")));
      return false;
    }
    if (m.msg_qp != p.remote_msg || m.write_qp != p.remote_write) {
      fail(p, std::make_exception_ptr(FabricError(
                  who(p) + ": " + to_string(m.type) + " names QPs " +
                  std::to_string(m.msg_qp.qpn) + "/" + std::to_string(m.write_qp.qpn) +
                  ", already connected to " + std::to_string(p.remote_msg.qpn) + "/" +
                  std::to_string(p.remote_write.qpn))));
      return false;
    }
    ++stats_.duplicate;
    return true;
  }
  p.remote_session = m.session;
  p.remote_ud = m.ud;
  p.remote_msg = m.msg_qp;
  p.remote_write = m.write_qp;
  p.remote_region = m.region;
  p.remote_known = true;
  try {
    if (!p.msg_qp) create_qps(p);
    // Each of our QPs is wired to the peer's QP of the same role.
    const RcRemote msg_remote{m.ud.addr, m.msg_qp.qpn, m.msg_qp.psn};
    const RcRemote write_remote{m.ud.addr, m.write_qp.qpn, m.write_qp.psn};
    p.msg_qp->to_rtr(&msg_remote);
    p.msg_qp->to_rts(p.local_msg.psn);
    p.write_qp->to_rtr(&write_remote);
    p.write_qp->to_rts(p.local_write.psn);
  } catch (const Error& e) {
    fail(p, std::make_exception_ptr(FabricError(who(p) + ": " + e.what())));
    return false;
  }
  return true;
}

void Handshake::on_datagram(std::span<const uint8_t> bytes, Clock::time_point now) {
  std::string why;
  auto m = decode(bytes, &why);
  if (!m) {
    ++stats_.malformed;
    return;
  }
  on_message(*m, now);
}

void Handshake::on_message(const HandshakeMsg& m, Clock::time_point now) {
  if (m.to != local_.id) {
    ++stats_.misdirected;
    return;
  }
  auto it = peers_.find(m.from);
  if (it == peers_.end() && options_.accept_unknown_peers && m.type == MsgType::kHello &&
      m.from != local_.id) {
    expect(m.from, "node " + std::to_string(m.from), now);
    it = peers_.find(m.from);
  }
  if (it == peers_.end()) {
    ++stats_.unknown_peer;
    return;
  }
  PeerConnection& p = it->second;
  if (p.state == PeerState::kFailed) {
    ++stats_.late;
    return;
  }
  if (m.type == MsgType::kHello) {
    if (!learn_remote(p, m)) return;
    if (p.state == PeerState::kHelloSent) p.state = PeerState::kRtsAwaitAck;
    if (p.state == PeerState::kExpecting) p.state = PeerState::kConnected;
    // Always answer: our previous ACK may have been lost.
    send_msg(p, MsgType::kAck, now);
    return;
  }
  // ACK
  if (m.echo_session != local_.session) {
    ++stats_.stale;  // answers a HELLO of an earlier incarnation of ours
    return;
  }
  if (p.state == PeerState::kExpecting) {
    ++stats_.unexpected;  // we never sent a HELLO to this peer
    return;
  }
  if (!learn_remote(p, m)) return;
  p.state = PeerState::kConnected;
}

void Handshake::tick(Clock::time_point now) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  for (auto& [node, p] : peers_) {
    if (p.state == PeerState::kHelloSent || p.state == PeerState::kRtsAwaitAck) {
      if (now < p.deadline) continue;
      if (p.hellos_sent < options_.max_attempts) {
        send_msg(p, MsgType::kHello, now);
        continue;
      }
      const auto ms = duration_cast<milliseconds>(now - p.started).count();
      fail(p, std::make_exception_ptr(TimeoutError(
                  who(p) + ": no ACK after " + std::to_string(p.hellos_sent) + " HELLOs in " +
                  std::to_string(ms) + " ms (" +
                  (p.remote_known ? "the peer's HELLO arrived, our HELLOs or its ACKs were lost"
                                  : "nothing heard from the peer") +
                  ")")));
    } else if (p.state == PeerState::kExpecting && now - p.started >= options_.passive_timeout) {
      fail(p, std::make_exception_ptr(TimeoutError(
                  who(p) + ": no HELLO within " +
                  std::to_string(options_.passive_timeout.count()) + " ms")));
    }
  }
}

void Handshake::fail(PeerConnection& p, std::exception_ptr e) {
  p.state = PeerState::kFailed;
  p.error = e;
}

const PeerConnection& Handshake::peer(uint64_t node) const {
  auto it = peers_.find(node);
  if (it == peers_.end()) {
    throw InvalidArgument("verbs handshake: unknown peer node " + std::to_string(node));
  }
  return it->second;
}

bool Handshake::ready(uint64_t node) const {
  const PeerConnection& p = peer(node);
  if (p.error) std::rethrow_exception(p.error);
  return p.state == PeerState::kConnected;
}

bool Handshake::all_settled() const {
  for (const auto& [node, p] : peers_) {
    if (p.state != PeerState::kConnected && p.state != PeerState::kFailed) return false;
  }
  return true;
}

}  // namespace moelink::fabric::verbs
