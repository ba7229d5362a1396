// The verbs transport (VerbsNic) driven by hand, without the engine: two or
// three NICs on fake devices, polled by the test, with a sink that records
// what each poll reports. Checks the WRs the NIC posts (chains, doorbells,
// signaling, byte order), slot accounting, receives, RNR, error mapping and
// the handshake's timeout.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fabric/verbs/verbs_address.h"
#include "fabric/verbs/verbs_nic.h"
#include "fake_verbs.h"
#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

struct RecordingSink final : CompletionSink {
  std::vector<WrContext*> done;
  std::vector<std::pair<WrContext*, std::string>> failed;
  std::vector<uint32_t> imms;
  std::vector<std::string> messages;
  void wr_done(WrContext* c) override { done.push_back(c); }
  void wr_failed(WrContext* c, const std::string& why, bool) override {
    failed.emplace_back(c, why);
  }
  void imm_arrived(uint32_t imm) override { imms.push_back(imm); }
  void message_arrived(const char* d, size_t n) override { messages.emplace_back(d, n); }
};

struct TestNic {
  fake::FakeDevice* dev = nullptr;  // owned by nic
  std::unique_ptr<VerbsNic> nic;
  RecordingSink sink;
  int poll() { return nic->poll(sink); }
};

VerbsNicOptions small_options() {
  VerbsNicOptions o;
  o.timeout_s = 2.0;
  o.rx = ReceiveConfig{256, 4};
  o.write_send_depth = 16;
  o.write_recv_depth = 32;
  o.msg_send_depth = 8;
  o.max_chain = 32;
  o.max_inline = 16;
  o.cq_depth = 4096;
  return o;
}

// A two-sided send of len bytes at buf (registered: desc) to dest.
Wr send_wr(uint64_t dest, char* buf, size_t len, void* desc) {
  Wr w;
  w.kind = Wr::Kind::kSend;
  w.dest = dest;
  w.buf = buf;
  w.len = len;
  w.desc = desc;
  return w;
}

class VerbsNicTest : public testing::Test {
 protected:
  void SetUp() override { fabric.auto_progress = true; }
  TestNic make(uint16_t lid, VerbsNicOptions o = small_options()) {
    auto dev = std::make_unique<fake::FakeDevice>(lid);
    fabric.add(*dev);
    TestNic t;
    t.dev = dev.get();
    t.nic = std::make_unique<VerbsNic>(std::move(dev), 0, o);
    return t;
  }
  // Connects a and b both ways; returns (a's handle of b, b's handle of a).
  std::pair<uint64_t, uint64_t> connect(TestNic& a, TestNic& b) {
    const uint64_t ab = a.nic->insert_peer(b.nic->endpoint(), "b");
    const uint64_t ba = b.nic->insert_peer(a.nic->endpoint(), "a");
    for (int i = 0; i < 1000 && !(a.nic->peer_ready(ab) && b.nic->peer_ready(ba)); ++i) {
      a.poll();
      b.poll();
    }
    EXPECT_TRUE(a.nic->peer_ready(ab) && b.nic->peer_ready(ba)) << "handshake did not finish";
    return {ab, ba};
  }
  // The RC QPs of a device in creation order: message QP, write QP per peer.
  static fake::FakeQp& rc_qp(fake::FakeDevice& d, int peer, bool write) {
    std::vector<fake::FakeQp*> rc;
    for (fake::FakeQp* q : d.qps)
      if (q->type() == QpType::kRc) rc.push_back(q);
    return *rc.at(static_cast<size_t>(2 * peer + (write ? 1 : 0)));
  }
  fake::FakeFabric fabric;  // outlives the NICs (declared first)
};

// A registration on one NIC, deregistered at scope end (before the NIC).
struct ScopedMr {
  ScopedMr(VerbsNic& n, void* p, size_t len)
      : nic(n), h(n.register_memory(p, len, MemoryKind::kHost, 0)) {}
  ~ScopedMr() { nic.deregister_memory(h); }
  ScopedMr(const ScopedMr&) = delete;
  ScopedMr& operator=(const ScopedMr&) = delete;
  VerbsNic& nic;
  MemoryHandle h;
};

struct Buffers {
  std::vector<uint8_t> src = std::vector<uint8_t>(4096), dst = std::vector<uint8_t>(4096, 0);
  ScopedMr src_reg, dst_reg;
  const MemoryHandle& src_mr = src_reg.h;
  const MemoryHandle& dst_mr = dst_reg.h;
  Buffers(VerbsNic& a, VerbsNic& b)
      : src_reg(a, src.data(), src.size()), dst_reg(b, dst.data(), dst.size()) {
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  }
  Wr write(uint64_t dest, uint64_t src_off, uint64_t dst_off, size_t len,
           std::optional<uint32_t> imm) const {
    Wr w;
    w.kind = Wr::Kind::kWrite;
    w.dest = dest;
    w.buf = const_cast<uint8_t*>(src.data()) + src_off;
    w.len = len;
    w.desc = src_mr.desc;
    w.remote_addr = dst_mr.remote_base + dst_off;
    w.remote_key = dst_mr.key;
    w.has_imm = imm.has_value();
    w.imm = imm.value_or(0);
    return w;
  }
};

TEST_F(VerbsNicTest, EndpointIsTheUdContactAndPeersGetReceivesBeforeHello) {
  TestNic a = make(1), b = make(2);
  const VerbsEndpoint ea = decode_endpoint(a.nic->endpoint(), "a");
  EXPECT_EQ(ea.node, a.nic->node_id());
  EXPECT_EQ(ea.ud.addr, a.dev->address());
  (void)a.nic->insert_peer(b.nic->endpoint(), "b");
  fake::FakeLock lock(fake::fake_mutex());
  fake::FakeQp& msg = rc_qp(*a.dev, 0, false);
  fake::FakeQp& wq = rc_qp(*a.dev, 0, true);
  EXPECT_EQ(msg.state(), QpState::kInit);  // HELLO sent, nothing heard yet
  EXPECT_EQ(msg.unconsumed_recvs(), 4u);   // recv_buffers message slots
  ASSERT_EQ(msg.recvs.at(0).sges.size(), 1u);
  EXPECT_EQ(msg.recvs[0].sges[0].length, 256u);
  EXPECT_EQ(wq.unconsumed_recvs(), 32u);   // write_recv_depth immediate receives
  EXPECT_TRUE(wq.recvs.at(0).sges.empty());
  // One HELLO queued on the UD QP.
  size_t ud_sends = 0;
  for (fake::FakeQp* q : a.dev->qps)
    if (q->type() == QpType::kUd) ud_sends += q->sends.size();
  EXPECT_EQ(ud_sends, 1u);
}

TEST_F(VerbsNicTest, PostsWaitForTheHandshakeThenWriteWithImmediateInWireOrder) {
  TestNic a = make(1), b = make(2);
  Buffers buf(*a.nic, *b.nic);
  const uint64_t ab = a.nic->insert_peer(b.nic->endpoint(), "b");
  WrContext ctx{};
  PostError err;
  // Not connected yet: the worker would retry.
  EXPECT_EQ(a.nic->post(buf.write(ab, 0, 0, 8, 1u), &ctx, false, &err), PostStatus::kAgain);
  (void)b.nic->insert_peer(a.nic->endpoint(), "a");
  for (int i = 0; i < 100 && !a.nic->peer_ready(ab); ++i) {
    a.poll();
    b.poll();
  }
  ASSERT_TRUE(a.nic->peer_ready(ab));
  ASSERT_EQ(a.nic->post(buf.write(ab, 100, 200, 1000, 0x01020304u), &ctx, false, &err),
            PostStatus::kPosted);
  {
    fake::FakeLock lock(fake::fake_mutex());
    const fake::PostedSend& s = rc_qp(*a.dev, 0, true).sends.back();
    EXPECT_EQ(s.wr.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    EXPECT_EQ(s.wr.imm_data, htonl(0x01020304u));
    EXPECT_EQ(s.wr.wr.rdma.remote_addr, buf.dst_mr.remote_base + 200);
    EXPECT_EQ(s.wr.wr.rdma.rkey, static_cast<uint32_t>(buf.dst_mr.key));
    EXPECT_TRUE(s.wr.send_flags & IBV_SEND_SIGNALED);
  }
  for (int i = 0; i < 10; ++i) {
    a.poll();
    b.poll();
  }
  ASSERT_EQ(a.sink.done.size(), 1u);
  EXPECT_EQ(a.sink.done[0], &ctx);
  ASSERT_EQ(b.sink.imms.size(), 1u);
  EXPECT_EQ(b.sink.imms[0], 0x01020304u);
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(buf.dst[200 + i], buf.src[100 + i]) << i;
  EXPECT_EQ(buf.dst[199], 0);
  EXPECT_EQ(buf.dst[1200], 0);
  // The immediate's receive was reposted.
  fake::FakeLock lock(fake::fake_mutex());
  EXPECT_EQ(rc_qp(*b.dev, 0, true).unconsumed_recvs(), 32u);
}

TEST_F(VerbsNicTest, WritesPostedWithMoreAreOneDoorbellOnlyTheLastSignaled) {
  TestNic a = make(1), b = make(2);
  Buffers buf(*a.nic, *b.nic);
  auto [ab, ba] = connect(a, b);
  std::vector<WrContext> ctx(5);
  PostError err;
  const uint64_t before = a.nic->write_doorbells();
  for (int i = 0; i < 5; ++i)
    ASSERT_EQ(a.nic->post(buf.write(ab, 64 * i, 64 * i, 64, 9u), &ctx[i], i < 4, &err),
              PostStatus::kPosted);
  EXPECT_EQ(a.nic->write_doorbells(), before + 1);
  {
    fake::FakeLock lock(fake::fake_mutex());
    const auto& sends = rc_qp(*a.dev, 0, true).sends;
    ASSERT_GE(sends.size(), 5u);
    const int call = sends.back().call;
    std::vector<uint64_t> ids;
    for (size_t i = sends.size() - 5; i < sends.size(); ++i) {
      EXPECT_EQ(sends[i].call, call) << "WR " << i << " in another doorbell";
      EXPECT_EQ(bool(sends[i].wr.send_flags & IBV_SEND_SIGNALED), i + 1 == sends.size());
      ids.push_back(sends[i].wr.wr_id);
    }
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(std::unique(ids.begin(), ids.end()), ids.end()) << "wr_ids must differ";
  }
  for (int i = 0; i < 10; ++i) {
    a.poll();
    b.poll();
  }
  // One completion retired all five, in order.
  ASSERT_EQ(a.sink.done.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.sink.done[i], &ctx[i]);
  EXPECT_EQ(b.sink.imms, std::vector<uint32_t>(5, 9u));
  for (size_t i = 0; i < 320; ++i) ASSERT_EQ(buf.dst[i], buf.src[i]) << i;
  (void)ba;
}

TEST_F(VerbsNicTest, ChainsStopAtMaxChainAndAtTheSendQueueDepth) {
  VerbsNicOptions o = small_options();
  o.max_chain = 4;
  o.write_send_depth = 10;
  TestNic a = make(1, o), b = make(2, o);
  Buffers buf(*a.nic, *b.nic);
  auto [ab, ba] = connect(a, b);
  std::vector<WrContext> ctx(30);
  PostError err;
  const uint64_t before = a.nic->write_doorbells();
  int posted = 0;
  // All with `more`: chains of 4, 4, then 2 slots left -> the 11th waits.
  for (; posted < 30; ++posted) {
    const PostStatus s = a.nic->post(buf.write(ab, 0, 0, 8, 1u), &ctx[posted], true, &err);
    if (s != PostStatus::kPosted) {
      EXPECT_EQ(s, PostStatus::kAgain);
      break;
    }
  }
  EXPECT_EQ(posted, 10);
  EXPECT_EQ(a.nic->write_doorbells(), before + 3);  // 4 + 4, and the 2 flushed at kAgain
  {
    fake::FakeLock lock(fake::fake_mutex());
    EXPECT_LE(rc_qp(*a.dev, 0, true).outstanding, 10u);
  }
  for (int i = 0; i < 10; ++i) {
    a.poll();
    b.poll();
  }
  EXPECT_EQ(a.sink.done.size(), 10u);  // slots came back with the completions
  EXPECT_EQ(a.nic->post(buf.write(ab, 0, 0, 8, 1u), &ctx[posted], false, &err),
            PostStatus::kPosted);
  (void)ba;
}

TEST_F(VerbsNicTest, ErrorCompletionMidChainNamesStatusAndPeerAndBreaksIt) {
  TestNic a = make(1), b = make(2);
  Buffers buf(*a.nic, *b.nic);
  auto [ab, ba] = connect(a, b);
  std::vector<WrContext> ctx(4);
  PostError err;
  Wr bad = buf.write(ab, 0, 64, 8, 2u);
  bad.remote_key ^= 0x10;  // not the target's rkey
  ASSERT_EQ(a.nic->post(buf.write(ab, 0, 0, 8, 1u), &ctx[0], true, &err), PostStatus::kPosted);
  ASSERT_EQ(a.nic->post(bad, &ctx[1], true, &err), PostStatus::kPosted);
  ASSERT_EQ(a.nic->post(buf.write(ab, 0, 128, 8, 3u), &ctx[2], false, &err), PostStatus::kPosted);
  for (int i = 0; i < 10; ++i) {
    a.poll();
    b.poll();
  }
  ASSERT_EQ(a.sink.done.size(), 1u);
  EXPECT_EQ(a.sink.done[0], &ctx[0]);
  ASSERT_EQ(a.sink.failed.size(), 2u);
  EXPECT_EQ(a.sink.failed[0].first, &ctx[1]);
  EXPECT_NE(a.sink.failed[0].second.find("IBV_WC_REM_ACCESS_ERR"), std::string::npos)
      << a.sink.failed[0].second;
  EXPECT_NE(a.sink.failed[0].second.find("peer 'b'"), std::string::npos);
  EXPECT_NE(a.sink.failed[0].second.find("write QP"), std::string::npos);
  EXPECT_EQ(a.sink.failed[1].first, &ctx[2]);
  EXPECT_NE(a.sink.failed[1].second.find("IBV_WC_WR_FLUSH_ERR"), std::string::npos);
  EXPECT_EQ(b.sink.imms, std::vector<uint32_t>{1u});
  // Later posts fail at once, naming the first error.
  EXPECT_EQ(a.nic->post(buf.write(ab, 0, 0, 8, 1u), &ctx[3], false, &err), PostStatus::kFailed);
  EXPECT_FALSE(err.timeout);
  EXPECT_NE(err.text.find("IBV_WC_REM_ACCESS_ERR"), std::string::npos) << err.text;
  EXPECT_FALSE(a.nic->peer_ready(ab));
  (void)ba;
}

TEST_F(VerbsNicTest, MessagesAreCopiedOutAndReceivesRepostedRnrWaitsMeanwhile) {
  VerbsNicOptions o = small_options();
  o.rx = ReceiveConfig{64, 1};  // one receive buffer per peer
  TestNic a = make(1, o), b = make(2, o);
  auto [ab, ba] = connect(a, b);
  std::vector<char> msg(64);
  ScopedMr reg(*a.nic, msg.data(), msg.size());
  const MemoryHandle& mr = reg.h;
  std::vector<WrContext> ctx(3);
  PostError err;
  for (int i = 0; i < 3; ++i) {
    const int n = std::snprintf(msg.data() + 16 * i, 16, "message %d", i);
    const Wr w = send_wr(ab, msg.data() + 16 * i, static_cast<size_t>(n), mr.desc);
    ASSERT_EQ(a.nic->post(w, &ctx[i], false, &err), PostStatus::kPosted);
  }
  const uint64_t rnr_before = fabric.rnr_naks;
  for (int i = 0; i < 5; ++i) a.poll();  // b does not poll: its one receive stays used
  EXPECT_EQ(a.sink.done.size(), 1u);
  EXPECT_GT(fabric.rnr_naks, rnr_before);
  for (int i = 0; i < 20; ++i) {
    b.poll();
    a.poll();
  }
  ASSERT_EQ(b.sink.messages.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b.sink.messages[i], "message " + std::to_string(i));
  EXPECT_EQ(a.sink.done.size(), 3u);
  EXPECT_TRUE(a.sink.failed.empty());
  (void)ba;
}

TEST_F(VerbsNicTest, RnrRetriesRunningOutFailTheSendNamingThePeer) {
  VerbsNicOptions o = small_options();
  o.rx = ReceiveConfig{64, 1};
  TestNic a = make(1, o), b = make(2, o);
  auto [ab, ba] = connect(a, b);
  fabric.rnr_retry_passes = 3;
  std::vector<char> msg(64, 'x');
  ScopedMr reg(*a.nic, msg.data(), msg.size());
  const MemoryHandle& mr = reg.h;
  std::vector<WrContext> ctx(2);
  PostError err;
  for (int i = 0; i < 2; ++i) {
    const Wr w = send_wr(ab, msg.data(), 8, mr.desc);
    ASSERT_EQ(a.nic->post(w, &ctx[i], false, &err), PostStatus::kPosted);
  }
  for (int i = 0; i < 10; ++i) a.poll();
  ASSERT_EQ(a.sink.failed.size(), 1u);
  EXPECT_EQ(a.sink.failed[0].first, &ctx[1]);
  EXPECT_NE(a.sink.failed[0].second.find("IBV_WC_RNR_RETRY_EXC_ERR"), std::string::npos)
      << a.sink.failed[0].second;
  EXPECT_NE(a.sink.failed[0].second.find("message QP to peer 'b'"), std::string::npos);
  (void)ba;
}

TEST_F(VerbsNicTest, UnansweredHandshakeTimesOutNamingThePeer) {
  VerbsNicOptions o = small_options();
  o.timeout_s = 0.3;
  TestNic a = make(1, o);
  // A node whose UD QP exists nowhere on the fabric.
  VerbsEndpoint ghost;
  ghost.node = 0x77;
  ghost.ud.addr.lid = 99;
  ghost.ud.qpn = 0x99001;
  const uint64_t d = a.nic->insert_peer(encode_endpoint(ghost), "ghost");
  std::vector<uint8_t> src(8);
  ScopedMr reg(*a.nic, src.data(), src.size());
  const MemoryHandle& mr = reg.h;
  Wr w;
  w.dest = d;
  w.buf = src.data();
  w.len = 8;
  w.desc = mr.desc;
  WrContext ctx{};
  PostError err;
  const auto t0 = std::chrono::steady_clock::now();
  PostStatus s = PostStatus::kAgain;
  while (s == PostStatus::kAgain && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3)) {
    a.poll();
    s = a.nic->post(w, &ctx, false, &err);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(s, PostStatus::kFailed);
  EXPECT_TRUE(err.timeout);
  EXPECT_NE(err.text.find("peer 'ghost'"), std::string::npos) << err.text;
  EXPECT_NE(err.text.find("no ACK"), std::string::npos) << err.text;
  EXPECT_LT(took, 0.3) << "the handshake must give up before the engine timeout";
  EXPECT_GT(took, 0.15);
}

TEST_F(VerbsNicTest, ATargetThatNeverAddedTheWriterAcceptsIt) {
  TestNic a = make(1), b = make(2);
  Buffers buf(*a.nic, *b.nic);
  const uint64_t ab = a.nic->insert_peer(b.nic->endpoint(), "b");  // b never adds a
  for (int i = 0; i < 100 && !a.nic->peer_ready(ab); ++i) {
    a.poll();
    b.poll();
  }
  ASSERT_TRUE(a.nic->peer_ready(ab));
  WrContext ctx{};
  PostError err;
  ASSERT_EQ(a.nic->post(buf.write(ab, 0, 0, 32, 5u), &ctx, false, &err), PostStatus::kPosted);
  for (int i = 0; i < 10; ++i) {
    a.poll();
    b.poll();
  }
  EXPECT_EQ(b.sink.imms, std::vector<uint32_t>{5u});
  EXPECT_EQ(std::memcmp(buf.dst.data(), buf.src.data(), 32), 0);
}

TEST_F(VerbsNicTest, RejectsForeignAndOwnEndpointsAndCudaMemory) {
  TestNic a = make(1);
  try {
    a.nic->insert_peer(std::string("\x02\x00\x1f\x90\x7f\x00\x00\x01", 8), "tcp-peer");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'tcp-peer'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("libfabric"), std::string::npos) << e.what();
  }
  EXPECT_THROW(a.nic->insert_peer(a.nic->endpoint(), "me"), InvalidArgument);
  int x = 0;
  EXPECT_THROW(a.nic->register_memory(&x, sizeof(x), MemoryKind::kCuda, 0), FabricError);
}

TEST_F(VerbsNicTest, APeerTheCompletionQueueCannotHoldIsRefusedByName) {
  VerbsNicOptions o = small_options();
  o.cq_depth = 100;  // one peer needs 16 + 32 + 8 + 4 = 60 entries
  TestNic a = make(1, o), b = make(2, o), c = make(3, o);
  (void)a.nic->insert_peer(b.nic->endpoint(), "b");
  try {
    a.nic->insert_peer(c.nic->endpoint(), "c");
    FAIL() << "expected FabricError";
  } catch (const FabricError& e) {
    EXPECT_NE(std::string(e.what()).find("completion queue of depth 100"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("'c'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moelink::fabric::verbs
