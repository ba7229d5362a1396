// The RC handshake state machine over a scripted, lossy message wire and the
// fake QP layer: lost, duplicated, reordered, late and foreign messages,
// simultaneous opens, timeouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "fabric/verbs/handshake.h"
#include "fake_verbs.h"
#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

using std::chrono::milliseconds;
const Clock::time_point kT0 = Clock::time_point{} + std::chrono::hours(1);

struct Wire {
  UdContact to;
  HandshakeMsg msg;
};

struct Net;

struct Node {
  Node(Net& net, uint64_t id, uint64_t session, HandshakeOptions options);
  uint64_t id;
  fake::FakeDevice dev;
  std::unique_ptr<Cq> cq;
  LocalNode local;
  std::unique_ptr<Handshake> hs;
  UdContact contact() const { return local.ud; }
};

struct Net {
  std::vector<Wire> inflight;
  std::map<uint16_t, Node*> by_lid;
  Clock::time_point now = kT0;

  void deliver(size_t i) {
    Wire w = inflight[i];
    inflight.erase(inflight.begin() + i);
    if (auto it = by_lid.find(w.to.addr.lid); it != by_lid.end()) {
      it->second->hs->on_message(w.msg, now);
    }
  }
  void run() {
    while (!inflight.empty()) deliver(0);
  }
  void drop_all() { inflight.clear(); }
};

HandshakeOptions fast_options() {
  HandshakeOptions o;
  o.retry_interval = milliseconds(100);
  o.max_attempts = 3;
  o.passive_timeout = milliseconds(1000);
  return o;
}

Node::Node(Net& net, uint64_t node_id, uint64_t session, HandshakeOptions options)
    : id(node_id), dev(static_cast<uint16_t>(node_id)) {
  cq = dev.create_cq(64);
  local.id = node_id;
  local.session = session;
  local.ud = {dev.address(), 0x900 + static_cast<uint32_t>(node_id)};
  local.region = {0x10000 * node_id, static_cast<uint32_t>(0x50 + node_id), 4096};
  net.by_lid[dev.address().lid] = this;
  hs = std::make_unique<Handshake>(dev, *cq, local, options,
                                   [&net](const UdContact& to, const HandshakeMsg& m) {
                                     net.inflight.push_back({to, m});
                                   });
}

fake::FakeQp& fq(const std::unique_ptr<Qp>& q) { return static_cast<fake::FakeQp&>(*q); }

// a's QPs are wired to b's QPs of the same role, with each other's PSNs,
// through exactly one RESET->INIT->RTR->RTS sequence.
void expect_wired(const Node& a, const Node& b) {
  const PeerConnection& pa = a.hs->peer(b.id);
  const PeerConnection& pb = b.hs->peer(a.id);
  ASSERT_EQ(pa.state, PeerState::kConnected) << to_string(pa.state);
  ASSERT_EQ(pb.state, PeerState::kConnected) << to_string(pb.state);
  const std::vector<QpState> once{QpState::kReset, QpState::kInit, QpState::kRtr, QpState::kRts};
  for (int role = 0; role < 2; ++role) {
    const auto& qa = fq(role ? pa.write_qp : pa.msg_qp);
    const QpEnd& la = role ? pa.local_write : pa.local_msg;
    const QpEnd& lb = role ? pb.local_write : pb.local_msg;
    ASSERT_TRUE(qa.remote);
    EXPECT_EQ(qa.remote->qpn, lb.qpn);
    EXPECT_EQ(qa.remote->psn, lb.psn);  // our rq_psn = their sq_psn
    EXPECT_EQ(*qa.sq_psn, la.psn);
    EXPECT_EQ(qa.remote->addr, b.dev.address());
    EXPECT_EQ(qa.history, once);
    EXPECT_EQ(qa.qpn(), la.qpn);
  }
  EXPECT_EQ(pa.remote_region.rkey, b.local.region.rkey);
  EXPECT_EQ(pa.remote_ud, b.contact());
  EXPECT_TRUE(a.hs->ready(b.id));
}

template <typename E>
std::string error_of(const Handshake& hs, uint64_t node) {
  try {
    hs.ready(node);
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(VerbsHandshake, ActiveToPassive) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  EXPECT_EQ(a.hs->peer(2).state, PeerState::kHelloSent);
  EXPECT_EQ(b.dev.qps.size(), 0u);  // passive: QPs only when the HELLO comes
  net.run();
  expect_wired(a, b);
  expect_wired(b, a);
  EXPECT_EQ(a.hs->stats().hellos_sent, 1u);
  EXPECT_EQ(b.hs->stats().acks_sent, 1u);
  EXPECT_EQ(a.dev.qps.size(), 2u);  // exactly two RC QPs per peer
  EXPECT_EQ(b.dev.qps.size(), 2u);
}

TEST(VerbsHandshake, SimultaneousOpenEndsTheSameInEveryOrder) {
  // Deliver the two HELLOs (and what they trigger) in every order; the
  // result must not depend on it.
  std::vector<std::pair<uint32_t, uint32_t>> wiring;
  for (int order = 0; order < 3; ++order) {
    SCOPED_TRACE(order);
    Net net;
    Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
    a.hs->connect(2, "B", b.contact(), net.now);
    b.hs->connect(1, "A", a.contact(), net.now);
    ASSERT_EQ(net.inflight.size(), 2u);
    if (order == 1) std::swap(net.inflight[0], net.inflight[1]);
    if (order == 2) {  // A's HELLO and B's ACK arrive before B's HELLO
      Wire b_hello = net.inflight[1];
      net.inflight.pop_back();
      net.run();
      EXPECT_EQ(a.hs->peer(2).state, PeerState::kConnected);  // the ACK sufficed
      EXPECT_EQ(b.hs->peer(1).state, PeerState::kRtsAwaitAck);
      net.inflight.push_back(b_hello);
    }
    net.run();
    expect_wired(a, b);
    expect_wired(b, a);
    wiring.emplace_back(fq(a.hs->peer(2).msg_qp).remote->qpn,
                        fq(b.hs->peer(1).write_qp).remote->qpn);
  }
  EXPECT_EQ(wiring[0], wiring[1]);
  EXPECT_EQ(wiring[0], wiring[2]);
}

TEST(VerbsHandshake, LostHelloIsResentAfterTheRetryInterval) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  net.drop_all();
  a.hs->tick(net.now + milliseconds(99));
  EXPECT_TRUE(net.inflight.empty());
  net.now += milliseconds(100);
  a.hs->tick(net.now);
  ASSERT_EQ(net.inflight.size(), 1u);
  net.run();
  expect_wired(a, b);
  EXPECT_EQ(a.hs->stats().hellos_sent, 2u);
}

TEST(VerbsHandshake, LostAckIsAnsweredAgainWithoutNewQps) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  net.deliver(0);  // HELLO arrives, B connects and ACKs...
  EXPECT_EQ(b.hs->peer(1).state, PeerState::kConnected);
  net.drop_all();  // ...and the ACK is lost
  net.now += milliseconds(100);
  a.hs->tick(net.now);
  net.run();
  expect_wired(a, b);  // also checks B's QPs went through RTR only once
  EXPECT_EQ(b.hs->stats().acks_sent, 2u);
  EXPECT_EQ(b.hs->stats().duplicate, 1u);
  EXPECT_EQ(b.dev.qps.size(), 2u);
}

TEST(VerbsHandshake, DuplicatedMessagesAreHarmless) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  a.hs->connect(2, "B", b.contact(), net.now);
  b.hs->connect(1, "A", a.contact(), net.now);
  for (int i = 0; i < 50 && !net.inflight.empty(); ++i) {
    net.inflight.push_back(net.inflight.front());  // everything arrives twice
    net.deliver(0);
    net.deliver(0);
    if (a.hs->all_settled() && b.hs->all_settled()) net.drop_all();
  }
  expect_wired(a, b);
  expect_wired(b, a);
  EXPECT_GT(a.hs->stats().duplicate + b.hs->stats().duplicate, 0u);
}

TEST(VerbsHandshake, NoAnswerTimesOutNamingThePeer) {
  Net net;
  Node a(net, 1, 0xa1, fast_options());
  UdContact nowhere{};
  nowhere.addr.lid = 77;
  a.hs->connect(7, "rank7", nowhere, net.now);
  for (int i = 0; i < 5; ++i) {
    net.now += milliseconds(100);
    a.hs->tick(net.now);
  }
  EXPECT_EQ(a.hs->peer(7).state, PeerState::kFailed);
  EXPECT_EQ(a.hs->stats().hellos_sent, 3u);  // max_attempts
  const std::string e = error_of<TimeoutError>(*a.hs, 7);
  EXPECT_NE(e.find("peer 'rank7' (node 7)"), std::string::npos) << e;
  EXPECT_NE(e.find("no ACK after 3 HELLOs in 300 ms"), std::string::npos) << e;
  EXPECT_NE(e.find("nothing heard"), std::string::npos) << e;
  EXPECT_TRUE(a.hs->all_settled());
}

TEST(VerbsHandshake, PassiveSideTimesOutWithoutHello) {
  Net net;
  Node b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  b.hs->tick(net.now + milliseconds(999));
  EXPECT_EQ(b.hs->peer(1).state, PeerState::kExpecting);
  b.hs->tick(net.now + milliseconds(1000));
  const std::string e = error_of<TimeoutError>(*b.hs, 1);
  EXPECT_NE(e.find("peer 'A' (node 1): no HELLO within 1000 ms"), std::string::npos) << e;
}

TEST(VerbsHandshake, LateAckAfterTimeoutIsIgnored) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  net.deliver(0);  // B answers, but the ACK is held back...
  for (int i = 0; i < 4; ++i) {
    net.now += milliseconds(100);
    a.hs->tick(net.now);
    while (net.inflight.size() > 1) net.inflight.pop_back();  // ...and retries lost
  }
  ASSERT_EQ(a.hs->peer(2).state, PeerState::kFailed);
  net.run();  // the old ACK finally arrives
  EXPECT_EQ(a.hs->peer(2).state, PeerState::kFailed);
  EXPECT_EQ(a.hs->stats().late, 1u);
  EXPECT_THROW(a.hs->ready(2), TimeoutError);
}

TEST(VerbsHandshake, ForeignMessagesAreCountedAndIgnored) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options()),
      c(net, 3, 0xc1, fast_options());
  b.hs->expect(1, "A", net.now);
  c.hs->connect(2, "B", b.contact(), net.now);  // B does not know C
  net.run();
  EXPECT_EQ(b.hs->stats().unknown_peer, 1u);
  EXPECT_EQ(b.hs->stats().acks_sent, 0u);
  EXPECT_EQ(b.dev.qps.size(), 0u);

  HandshakeMsg m;
  m.from = 1;
  m.to = 99;  // meant for another node
  b.hs->on_message(m, net.now);
  EXPECT_EQ(b.hs->stats().misdirected, 1u);

  const uint8_t junk[5] = {1, 2, 3, 4, 5};
  b.hs->on_datagram(junk, net.now);
  EXPECT_EQ(b.hs->stats().malformed, 1u);

  m.to = 2;
  m.type = MsgType::kAck;  // ACK to a passive peer that never sent HELLO
  m.echo_session = 0xb1;
  b.hs->on_message(m, net.now);
  EXPECT_EQ(b.hs->stats().unexpected, 1u);
  EXPECT_EQ(b.hs->peer(1).state, PeerState::kExpecting);
}

TEST(VerbsHandshake, AckOfAnEarlierIncarnationIsStale) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  a.hs->connect(2, "B", b.contact(), net.now);
  net.drop_all();
  HandshakeMsg ack;
  ack.type = MsgType::kAck;
  ack.from = 2;
  ack.to = 1;
  ack.session = 0xb1;
  ack.echo_session = 0xa0;  // A's previous session
  ack.msg_qp = {5, 5};
  a.hs->on_message(ack, net.now);
  EXPECT_EQ(a.hs->stats().stale, 1u);
  EXPECT_EQ(a.hs->peer(2).state, PeerState::kHelloSent);
  EXPECT_FALSE(a.hs->peer(2).remote_known);
}

TEST(VerbsHandshake, PeerRestartFailsThePeer) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  net.run();
  ASSERT_TRUE(b.hs->ready(1));
  // A restarts: new session, new QPs.
  Net net2;
  Node a2(net2, 1, 0xa2, fast_options());
  a2.hs->connect(2, "B", b.contact(), net2.now);
  b.hs->on_message(net2.inflight.at(0).msg, net.now);
  const std::string e = error_of<FabricError>(*b.hs, 1);
  EXPECT_NE(e.find("peer 'A' (node 1): the peer restarted (session 161, now 162)"),
            std::string::npos)
      << e;
}

TEST(VerbsHandshake, DifferentQpsUnderTheSameSessionFailThePeer) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  HandshakeMsg hello = net.inflight.at(0).msg;
  net.run();
  hello.msg_qp.qpn += 1;
  b.hs->on_message(hello, net.now);
  const std::string e = error_of<FabricError>(*b.hs, 1);
  EXPECT_NE(e.find("already connected to"), std::string::npos) << e;
}

TEST(VerbsHandshake, QpCreationFailureFailsThePeer) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  a.dev.fail_create_qp = "out of QPs";
  EXPECT_THROW(a.hs->connect(2, "B", b.contact(), net.now), FabricError);
  EXPECT_EQ(a.hs->peer(2).state, PeerState::kFailed);
  // Passive side: the failure surfaces when the HELLO arrives.
  b.dev.fail_create_qp = "out of QPs";
  b.hs->expect(3, "C", net.now);
  Node c(net, 3, 0xc1, fast_options());
  c.hs->connect(2, "B", b.contact(), net.now);
  net.run();
  const std::string e = error_of<FabricError>(*b.hs, 3);
  EXPECT_NE(e.find("peer 'C' (node 3): fake ibv_create_qp: out of QPs"), std::string::npos) << e;
}

TEST(VerbsHandshake, AcceptingUnknownPeersAnswersTheirHello) {
  Net net;
  HandshakeOptions accepting = fast_options();
  accepting.accept_unknown_peers = true;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, accepting);
  a.hs->connect(2, "B", b.contact(), net.now);  // b never heard of node 1
  net.run();
  expect_wired(a, b);
  EXPECT_EQ(b.hs->peer(1).name, "node 1");
  EXPECT_EQ(b.hs->stats().unknown_peer, 0u);
  // Adding it later only renames it: no new QPs, no new HELLO.
  b.hs->connect(1, "A", a.contact(), net.now);
  EXPECT_EQ(b.hs->peer(1).name, "A");
  EXPECT_EQ(b.hs->peer(1).state, PeerState::kConnected);
  EXPECT_EQ(b.dev.qps.size(), 2u);
  EXPECT_TRUE(net.inflight.empty());
  // An ACK from an unknown node is still ignored (only HELLOs open).
  Node c(net, 3, 0xc1, fast_options());
  HandshakeMsg ack;
  ack.type = MsgType::kAck;
  ack.from = 3;
  ack.to = 2;
  ack.session = 0xc1;
  b.hs->on_message(ack, net.now);
  EXPECT_EQ(b.hs->stats().unknown_peer, 1u);
}

TEST(VerbsHandshake, QpsCreatedHookRunsInInitBeforeAnyMessageNamesTheQps) {
  Net net;
  Node a(net, 1, 0xa1, fast_options()), b(net, 2, 0xb1, fast_options());
  struct Seen {
    uint64_t node;
    QpState msg, write;
    size_t inflight;
  };
  std::vector<Seen> seen_a, seen_b;
  a.hs->on_qps_created([&](uint64_t node, Qp& m, Qp& w) {
    seen_a.push_back({node, m.state(), w.state(), net.inflight.size()});
  });
  b.hs->on_qps_created([&](uint64_t node, Qp& m, Qp& w) {
    seen_b.push_back({node, m.state(), w.state(), net.inflight.size()});
  });
  b.hs->expect(1, "A", net.now);
  a.hs->connect(2, "B", b.contact(), net.now);
  ASSERT_EQ(seen_a.size(), 1u);
  EXPECT_EQ(seen_a[0].node, 2u);
  EXPECT_EQ(seen_a[0].msg, QpState::kInit);
  EXPECT_EQ(seen_a[0].write, QpState::kInit);
  EXPECT_EQ(seen_a[0].inflight, 0u);  // before the HELLO went out
  net.deliver(0);                     // the HELLO reaches b
  ASSERT_EQ(seen_b.size(), 1u);
  EXPECT_EQ(seen_b[0].msg, QpState::kInit);  // before RTR
  EXPECT_EQ(seen_b[0].inflight, 0u);         // and before the ACK
  net.run();
  expect_wired(a, b);
  EXPECT_EQ(seen_a.size(), 1u);  // once per peer
  EXPECT_EQ(seen_b.size(), 1u);
  // A hook that throws fails the peer like a QP creation failure.
  Node c(net, 3, 0xc1, fast_options());
  c.hs->on_qps_created([](uint64_t, Qp&, Qp&) { throw FabricError("no receive buffers"); });
  EXPECT_THROW(c.hs->connect(2, "B", b.contact(), net.now), FabricError);
  EXPECT_NE(error_of<FabricError>(*c.hs, 2).find("no receive buffers"), std::string::npos);
}

TEST(VerbsHandshake, InvalidUse) {
  Net net;
  Node a(net, 1, 0xa1, fast_options());
  EXPECT_THROW(a.hs->connect(1, "self", a.contact(), net.now), InvalidArgument);
  EXPECT_THROW(a.hs->peer(5), InvalidArgument);
  fake::FakeDevice d(9);
  auto cq = d.create_cq(4);
  LocalNode zero;
  zero.id = 9;
  EXPECT_THROW(Handshake(d, *cq, zero, fast_options(), {}), InvalidArgument);
}

// Every pair of 4 nodes connects at once (both sides active) over a wire
// that drops, duplicates and reorders; many seeds. All must connect, wired
// to each other's single QP pair.
TEST(VerbsHandshake, LossyReorderingWireAllToAll) {
  HandshakeOptions o = fast_options();
  o.max_attempts = 60;
  int total_hellos = 0;
  for (uint32_t seed = 0; seed < 200; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    Net net;
    std::vector<std::unique_ptr<Node>> nodes;
    for (uint64_t id = 1; id <= 4; ++id) {
      nodes.push_back(std::make_unique<Node>(net, id, 0x1000 * id + seed + 1, o));
    }
    for (auto& x : nodes) {
      for (auto& y : nodes) {
        if (x == y) continue;
        std::string name = "n";
        name += std::to_string(y->id);  // (not "n" + ...: GCC 12 -Wrestrict false positive)
        x->hs->connect(y->id, name, y->contact(), net.now);
      }
    }
    std::uniform_real_distribution<double> u(0, 1);
    for (int step = 0; step < 20000; ++step) {
      bool settled = true;
      for (auto& n : nodes) settled &= n->hs->all_settled();
      if (settled) break;
      if (net.inflight.empty() || u(rng) < 0.05) {
        net.now += milliseconds(100);
        for (auto& n : nodes) n->hs->tick(net.now);
        continue;
      }
      const size_t i = std::uniform_int_distribution<size_t>(0, net.inflight.size() - 1)(rng);
      const double r = u(rng);
      if (r < 0.3) {
        net.inflight.erase(net.inflight.begin() + i);  // lost
      } else if (r < 0.5) {
        net.inflight.push_back(net.inflight[i]);  // duplicated, delivered later
        net.deliver(i);
      } else {
        net.deliver(i);
      }
    }
    for (auto& x : nodes) {
      for (auto& y : nodes) {
        if (x != y) expect_wired(*x, *y);
      }
      total_hellos += static_cast<int>(x->hs->stats().hellos_sent);
      EXPECT_EQ(x->dev.qps.size(), 6u);  // 2 per peer, never more
    }
    if (HasFailure()) break;
  }
  RecordProperty("hellos_sent", total_hellos);
}

}  // namespace
}  // namespace moelink::fabric::verbs
