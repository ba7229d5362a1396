// The UD channel on the fake layer, and the whole setup path end to end:
// two handshakes talking through two UD channels over a lossy fake fabric.
#include <gtest/gtest.h>

#include <random>

#include "fabric/verbs/handshake.h"
#include "fabric/verbs/ud_channel.h"
#include "fake_verbs.h"
#include "moelink/errors.h"

namespace moelink::fabric::verbs {
namespace {

fake::FakeQp& fq(Qp& q) { return static_cast<fake::FakeQp&>(q); }

TEST(VerbsUdChannel, SetsUpQpAndPostsReceives) {
  fake::FakeDevice dev(1);
  UdChannel ch(dev, 8, 4);
  auto& q = fq(ch.qp());
  EXPECT_EQ(q.type(), QpType::kUd);
  EXPECT_EQ(q.state(), QpState::kRts);
  EXPECT_EQ(q.qkey, UdChannel::kQkey);
  ASSERT_EQ(q.recvs.size(), 8u);
  for (uint32_t i = 0; i < 8; ++i) {
    EXPECT_EQ(q.recvs[i].wr.wr_id, i);
    ASSERT_EQ(q.recvs[i].sges.size(), 1u);
    EXPECT_EQ(q.recvs[i].sges[0].length, UdChannel::kGrhBytes + UdChannel::kMaxPayload);
  }
  EXPECT_EQ(ch.contact().qpn, q.qpn());
  EXPECT_EQ(ch.contact().addr, dev.address());
}

TEST(VerbsUdChannel, SendWrFields) {
  fake::FakeDevice dev(1);
  UdChannel ch(dev, 4, 4);
  UdContact to{};
  to.addr.lid = 2;
  to.qpn = 0x2001;
  const std::vector<uint8_t> msg{1, 2, 3};
  ASSERT_TRUE(ch.send(to, msg));
  ASSERT_TRUE(ch.send(to, msg));
  auto& q = fq(ch.qp());
  ASSERT_EQ(q.sends.size(), 2u);
  const ibv_send_wr& wr = q.sends[0].wr;
  EXPECT_EQ(wr.opcode, IBV_WR_SEND);
  EXPECT_EQ(wr.send_flags, unsigned{IBV_SEND_SIGNALED});
  EXPECT_EQ(wr.wr.ud.remote_qpn, 0x2001u);
  EXPECT_EQ(wr.wr.ud.remote_qkey, UdChannel::kQkey);
  const fake::FakeAh* ah = dev.ah_of(wr.wr.ud.ah);
  ASSERT_NE(ah, nullptr);
  EXPECT_EQ(ah->dest, to.addr);
  EXPECT_EQ(dev.ah_count(), 1u);  // one address handle per destination, cached
  EXPECT_EQ(q.sends[0].sges.at(0).length, 3u);
  EXPECT_THROW(ch.send(to, std::vector<uint8_t>(UdChannel::kMaxPayload + 1)), InvalidArgument);
}

TEST(VerbsUdChannel, DeliversPayloadRepostsAndRecyclesSendSlots) {
  fake::FakeDevice da(1), db(2);
  fake::FakeFabric fabric;
  fabric.add(da);
  fabric.add(db);
  UdChannel a(da, 4, 2), b(db, 4, 2);
  const std::vector<uint8_t> m1{9, 8, 7}, m2{6};
  EXPECT_TRUE(a.send(b.contact(), m1));
  EXPECT_TRUE(a.send(b.contact(), m2));
  EXPECT_FALSE(a.send(b.contact(), m1));  // both send slots busy: dropped
  EXPECT_EQ(a.dropped_sends(), 1u);
  EXPECT_EQ(fabric.pump(), 2);
  std::vector<std::vector<uint8_t>> got;
  b.poll([&](std::span<const uint8_t> d) { got.emplace_back(d.begin(), d.end()); });
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], m1);  // GRH stripped
  EXPECT_EQ(got[1], m2);
  EXPECT_EQ(fq(b.qp()).recvs.size(), 6u);  // both receives reposted
  EXPECT_EQ(a.poll([](auto) {}), 2);      // send completions free the slots
  EXPECT_TRUE(a.send(b.contact(), m1));
}

// HELLO/ACK through real UD channel code, the fake fabric dropping and
// duplicating datagrams at random.
TEST(VerbsUdChannel, HandshakeEndToEndOverLossyFabric) {
  for (uint32_t seed = 0; seed < 50; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    fake::FakeDevice da(1), db(2);
    fake::FakeFabric fabric;
    fabric.add(da);
    fabric.add(db);
    UdChannel ua(da), ub(db);
    auto cqa = da.create_cq(64), cqb = db.create_cq(64);
    HandshakeOptions o;
    o.retry_interval = std::chrono::milliseconds(10);
    o.max_attempts = 40;
    auto sender = [](UdChannel& ch) {
      return [&ch](const UdContact& to, const HandshakeMsg& m) { ch.send(to, encode(m)); };
    };
    Handshake ha(da, *cqa, {1, 0xa0 + seed + 1, ua.contact(), {}}, o, sender(ua));
    Handshake hb(db, *cqb, {2, 0xb0 + seed + 1, ub.contact(), {}}, o, sender(ub));
    Clock::time_point now{};
    ha.connect(2, "B", ub.contact(), now);
    hb.connect(1, "A", ua.contact(), now);
    for (int i = 0; i < 1000 && !(ha.all_settled() && hb.all_settled()); ++i) {
      fabric.pump([&](const std::vector<uint8_t>&) {
        const int r = static_cast<int>(rng() % 10);
        return r < 3 ? 0 : r < 5 ? 2 : 1;  // 30% lost, 20% duplicated
      });
      ua.poll([&](std::span<const uint8_t> d) { ha.on_datagram(d, now); });
      ub.poll([&](std::span<const uint8_t> d) { hb.on_datagram(d, now); });
      now += std::chrono::milliseconds(5);
      ha.tick(now);
      hb.tick(now);
    }
    ASSERT_TRUE(ha.ready(2));
    ASSERT_TRUE(hb.ready(1));
    EXPECT_EQ(fq(*ha.peer(2).msg_qp).remote->qpn, hb.peer(1).local_msg.qpn);
    EXPECT_EQ(fq(*hb.peer(1).write_qp).remote->qpn, ha.peer(2).local_write.qpn);
    EXPECT_EQ(ha.stats().malformed + hb.stats().malformed, 0u);
  }
}

}  // namespace
}  // namespace moelink::fabric::verbs
