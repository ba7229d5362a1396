// WR builders: exact fields of what would reach ibv_post_send / recv.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstring>

#include "fabric/verbs/wr_builder.h"
#include "fake_verbs.h"
#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

const RemoteBuffer kRemote{0x7f0000001000, 0xabcd, 1 << 20};

TEST(VerbsWr, ImmediateIsBigEndianOnTheWire) {
  const uint32_t wire = imm_to_wire(0x01020304);
  uint8_t b[4];
  std::memcpy(b, &wire, 4);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[1], 2);
  EXPECT_EQ(b[2], 3);
  EXPECT_EQ(b[3], 4);
  EXPECT_EQ(imm_from_wire(wire), 0x01020304u);
  EXPECT_EQ(wire, htonl(0x01020304));
}

TEST(VerbsWr, WriteWithImmTemplateFields) {
  WriteTemplate t(kRemote, /*max_inline=*/64);
  ibv_send_wr* wr = t.fill({0x5000, 77, 4096, 128, 0xdeadbeef}, /*wr_id=*/42, /*signaled=*/true);
  EXPECT_EQ(wr->opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(wr->wr_id, 42u);
  EXPECT_EQ(wr->next, nullptr);
  EXPECT_EQ(wr->send_flags, unsigned{IBV_SEND_SIGNALED});  // 4096 > 64: not inline
  EXPECT_EQ(wr->imm_data, htonl(0xdeadbeef));
  EXPECT_EQ(wr->wr.rdma.remote_addr, kRemote.addr + 128);
  EXPECT_EQ(wr->wr.rdma.rkey, kRemote.rkey);
  ASSERT_EQ(wr->num_sge, 1);
  EXPECT_EQ(wr->sg_list->addr, 0x5000u);
  EXPECT_EQ(wr->sg_list->length, 4096u);
  EXPECT_EQ(wr->sg_list->lkey, 77u);
}

TEST(VerbsWr, TemplateRefillKeepsConstantsAndInlinesSmallWrites) {
  WriteTemplate t(kRemote, 64);
  t.fill({0x5000, 77, 4096, 0, 1}, 1, true);
  ibv_send_wr* wr = t.fill({0x6000, 78, 64, 8, std::nullopt}, 2, false);
  EXPECT_EQ(wr->opcode, IBV_WR_RDMA_WRITE);  // no immediate: plain write
  EXPECT_EQ(wr->imm_data, 0u);
  EXPECT_EQ(wr->send_flags, unsigned{IBV_SEND_INLINE});  // 64 <= max_inline, unsignaled
  EXPECT_EQ(wr->wr.rdma.rkey, kRemote.rkey);
  EXPECT_EQ(wr->wr.rdma.remote_addr, kRemote.addr + 8);
  EXPECT_EQ(wr->sg_list->addr, 0x6000u);
  EXPECT_EQ(wr->sg_list->lkey, 78u);
}

TEST(VerbsWr, ZeroByteWriteWithImmHasNoSge) {
  WriteTemplate t(kRemote, 64);
  ibv_send_wr* wr = t.fill({0, 0, 0, 0, 7}, 3, true);
  EXPECT_EQ(wr->opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(wr->num_sge, 0);
  EXPECT_EQ(wr->sg_list, nullptr);
  EXPECT_EQ(wr->send_flags, unsigned{IBV_SEND_SIGNALED});  // nothing to inline
}

TEST(VerbsWr, WriteOutsideRemoteBufferIsRejected) {
  WriteTemplate t(kRemote, 0);
  EXPECT_THROW(t.fill({0x5000, 1, 16, kRemote.size - 8, 1}, 0, true), InvalidArgument);
  EXPECT_THROW(t.fill({0x5000, 1, 16, ~uint64_t{0} - 4, 1}, 0, true), InvalidArgument);
  EXPECT_NO_THROW(t.fill({0x5000, 1, 16, kRemote.size - 16, 1}, 0, true));
  EXPECT_NO_THROW(t.fill({0x5000, 1, 0, kRemote.size, 1}, 0, true));
}

TEST(VerbsWr, ChainLinksAndSignalsOnlyTheLast) {
  WriteChain c(kRemote, QpCaps{16, 16, 1, 1, 32}, 8);
  for (uint32_t i = 0; i < 5; ++i) {
    c.add({0x1000 + i * 0x100, 9, i == 2 ? 1000u : 32u, i * 64, 100 + i});
  }
  ibv_send_wr* head = c.finish(555);
  int n = 0;
  for (ibv_send_wr* w = head; w; w = w->next, ++n) {
    SCOPED_TRACE(n);
    EXPECT_EQ(w->wr_id, 555u);  // error completions of any WR name the op
    EXPECT_EQ(w->opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    EXPECT_EQ(w->imm_data, htonl(100 + n));
    EXPECT_EQ(w->wr.rdma.remote_addr, kRemote.addr + n * 64);
    EXPECT_EQ(w->sg_list->addr, 0x1000u + n * 0x100);
    const bool last = n == 4;
    EXPECT_EQ(bool(w->send_flags & IBV_SEND_SIGNALED), last);
    EXPECT_EQ(bool(w->send_flags & IBV_SEND_INLINE), n != 2);  // 1000 > 32 bytes
    if (!last) {
      EXPECT_EQ(w->next, w + 1);  // contiguous array, linked in order
    }
  }
  EXPECT_EQ(n, 5);
}

TEST(VerbsWr, ChainCapacityRespectsMaxSendWr) {
  WriteChain c(kRemote, QpCaps{4, 4, 1, 1, 0}, 100);
  EXPECT_EQ(c.capacity(), 4u);
  for (int i = 0; i < 4; ++i) c.add({0x1000, 1, 8, 0, 1});
  EXPECT_TRUE(c.full());
  EXPECT_THROW(c.add({0x1000, 1, 8, 0, 1}), InvalidArgument);
  WriteChain d(kRemote, QpCaps{64, 4, 1, 1, 0}, 3);
  EXPECT_EQ(d.capacity(), 3u);
  EXPECT_THROW(WriteChain(kRemote, QpCaps{0, 4, 1, 1, 0}, 3), InvalidArgument);
}

TEST(VerbsWr, ChainRejectsBadOpWithoutGrowing) {
  WriteChain c(kRemote, QpCaps{8, 8, 1, 1, 0}, 8);
  c.add({0x1000, 1, 8, 0, 1});
  EXPECT_THROW(c.add({0x1000, 1, 8, kRemote.size, 1}), InvalidArgument);
  EXPECT_EQ(c.size(), 1u);
  EXPECT_EQ(c.finish(1)->next, nullptr);
  c.clear();
  EXPECT_EQ(c.finish(1), nullptr);  // empty chain: nothing to post
}

TEST(VerbsWr, ChainPostsWithOneDoorbellOnFakeQp) {
  fake::FakeDevice dev(1);
  auto cq = dev.create_cq(16);
  QpInit init{QpType::kRc, cq.get(), cq.get(), QpCaps{8, 8, 1, 1, 16}, 0};
  auto qp = dev.create_qp(init);
  auto& f = static_cast<fake::FakeQp&>(*qp);
  qp->to_init();
  RcRemote r{};
  r.qpn = 9;
  qp->to_rtr(&r);
  qp->to_rts(0);
  char src[64];
  std::memset(src, 'x', sizeof(src));
  WriteChain c(kRemote, qp->caps(), 16);
  c.add({reinterpret_cast<uint64_t>(src), 5, 8, 0, 1});
  c.add({reinterpret_cast<uint64_t>(src), 5, 64, 64, 2});
  c.add({reinterpret_cast<uint64_t>(src), 5, 0, 0, 3});
  qp->post_send(c.finish(11));
  ASSERT_EQ(f.sends.size(), 3u);
  EXPECT_EQ(f.send_calls, 1);
  EXPECT_EQ(f.sends[0].inline_bytes, std::vector<uint8_t>(8, 'x'));  // copied at post
  EXPECT_TRUE(f.sends[1].inline_bytes.empty());                       // 64 > 16
  EXPECT_EQ(f.sends[1].sges.at(0).length, 64u);
  EXPECT_TRUE(f.sends[2].sges.empty());
  EXPECT_TRUE(f.sends[2].wr.send_flags & IBV_SEND_SIGNALED);
  EXPECT_EQ(f.outstanding, 3u);
}

TEST(VerbsWr, FakeQpRejectsChainsBeyondTheSendQueueAndNamesTheWr) {
  fake::FakeDevice dev(1);
  auto cq = dev.create_cq(16);
  auto qp = dev.create_qp({QpType::kRc, cq.get(), cq.get(), QpCaps{4, 4, 1, 1, 0}, 0});
  auto& f = static_cast<fake::FakeQp&>(*qp);
  RcRemote r{};
  qp->to_init();
  qp->to_rtr(&r);
  qp->to_rts(0);
  WriteChain c(kRemote, qp->caps(), 3);
  for (int i = 0; i < 3; ++i) c.add({0x1000, 1, 8, 0, 1});
  qp->post_send(c.finish(1));
  // 3 of 4 slots in use until the signaled WR completes: a chain of 3 fails
  // at its second WR.
  try {
    qp->post_send(c.finish(2));
    FAIL() << "expected a send-queue-full rejection";
  } catch (const FabricError& e) {
    EXPECT_NE(std::string(e.what()).find("WR 1 rejected"), std::string::npos) << e.what();
  }
  f.retire(4);
  f.fail_send_at = 2;
  EXPECT_THROW(qp->post_send(c.finish(3)), FabricError);
  EXPECT_EQ(f.outstanding, 2u);  // WRs before the bad one were posted
}

TEST(VerbsWr, SendQueueSlots) {
  SendQueueSlots s(4);
  EXPECT_TRUE(s.try_take(3));
  EXPECT_FALSE(s.try_take(2));
  EXPECT_EQ(s.free(), 1u);
  s.give_back(3);
  EXPECT_TRUE(s.try_take(4));
  EXPECT_THROW(s.give_back(5), InvalidArgument);
}

TEST(VerbsWr, TwoSidedSend) {
  ibv_send_wr wr;
  ibv_sge sge;
  fill_send(wr, sge, 0x9000, 3, 48, 64, 17);
  EXPECT_EQ(wr.opcode, IBV_WR_SEND);
  EXPECT_EQ(wr.send_flags, unsigned{IBV_SEND_SIGNALED | IBV_SEND_INLINE});
  EXPECT_EQ(wr.wr_id, 17u);
  EXPECT_EQ(wr.sg_list, &sge);
  EXPECT_EQ(sge.addr, 0x9000u);
  EXPECT_EQ(sge.length, 48u);
  EXPECT_EQ(sge.lkey, 3u);
  fill_send(wr, sge, 0x9000, 3, 4096, 64, 18);
  EXPECT_EQ(wr.send_flags, unsigned{IBV_SEND_SIGNALED});
}

TEST(VerbsWr, ImmReceivesHaveNoSge) {
  RecvChain rc(8);
  ibv_recv_wr* head = rc.imm(100, 5);
  int n = 0;
  for (ibv_recv_wr* w = head; w; w = w->next, ++n) {
    EXPECT_EQ(w->wr_id, 100u + n);
    EXPECT_EQ(w->num_sge, 0);
    EXPECT_EQ(w->sg_list, nullptr);
  }
  EXPECT_EQ(n, 5);
  EXPECT_THROW(rc.imm(0, 9), InvalidArgument);
  EXPECT_THROW(rc.imm(0, 0), InvalidArgument);
}

TEST(VerbsWr, MessageReceivesTakeSlotsAndWrap) {
  RecvChain rc(8);
  ibv_recv_wr* head = rc.slots(0x10000, 7, 4096, /*total=*/6, /*first=*/4, /*n=*/4);
  const uint32_t want[] = {4, 5, 0, 1};
  int n = 0;
  for (ibv_recv_wr* w = head; w; w = w->next, ++n) {
    EXPECT_EQ(w->wr_id, want[n]);
    ASSERT_EQ(w->num_sge, 1);
    EXPECT_EQ(w->sg_list->addr, 0x10000u + want[n] * 4096);
    EXPECT_EQ(w->sg_list->length, 4096u);
    EXPECT_EQ(w->sg_list->lkey, 7u);
  }
  EXPECT_EQ(n, 4);
  EXPECT_THROW(rc.slots(0x10000, 7, 4096, 6, 6, 1), InvalidArgument);
  EXPECT_THROW(rc.slots(0x10000, 7, 4096, 6, 0, 7), InvalidArgument);
  EXPECT_THROW(rc.slots(0x10000, 7, 0, 6, 0, 1), InvalidArgument);
}

}  // namespace
}  // namespace moelink::fabric::verbs
