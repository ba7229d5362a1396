// The fake layer's RC semantics on two hand-connected QPs: the transport's
// tests rely on these rules, so they are pinned here first (bytes moved,
// receives consumed, RNR, access and length errors, flushes, PSNs).
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fabric/verbs/wr_builder.h"
#include "fake_verbs.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

struct RcPair {
  fake::FakeFabric fabric;
  fake::FakeDevice da{1}, db{2};
  std::unique_ptr<Cq> ca, cb;
  std::unique_ptr<Qp> qa, qb;
  std::vector<uint8_t> src = std::vector<uint8_t>(256), dst = std::vector<uint8_t>(256, 0);
  std::unique_ptr<Mr> src_mr, dst_mr;

  explicit RcPair(uint32_t psn_a = 100, uint32_t psn_b = 200, uint32_t b_expects = 100) {
    fabric.add(da);
    fabric.add(db);
    ca = da.create_cq(64);
    cb = db.create_cq(64);
    qa = da.create_qp({QpType::kRc, ca.get(), ca.get(), QpCaps{8, 8, 1, 1, 16}, 0});
    qb = db.create_qp({QpType::kRc, cb.get(), cb.get(), QpCaps{8, 8, 1, 1, 16}, 0});
    qa->to_init();
    qb->to_init();
    const RcRemote to_b{db.address(), qb->qpn(), psn_b};
    const RcRemote to_a{da.address(), qa->qpn(), b_expects};
    qa->to_rtr(&to_b);
    qa->to_rts(psn_a);
    qb->to_rtr(&to_a);
    qb->to_rts(psn_b);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 3 + 1);
    src_mr = da.register_memory(src.data(), src.size());
    dst_mr = db.register_memory(dst.data(), dst.size());
  }
  fake::FakeQp& fa() { return static_cast<fake::FakeQp&>(*qa); }
  fake::FakeQp& fb() { return static_cast<fake::FakeQp&>(*qb); }
  RemoteBuffer remote() const {
    return {reinterpret_cast<uint64_t>(dst.data()), dst_mr->rkey(), dst.size()};
  }
  WriteOp op(uint32_t len, uint64_t src_off, uint64_t dst_off, std::optional<uint32_t> imm) {
    return {reinterpret_cast<uint64_t>(src.data()) + src_off, src_mr->lkey(), len, dst_off, imm};
  }
  void post_imm_recvs(int n) {
    RecvChain rc(16);
    qb->post_recv(rc.imm(500, static_cast<uint32_t>(n)));
  }
  std::vector<ibv_wc> drain(Cq& cq) {
    std::vector<ibv_wc> out;
    ibv_wc wc[8];
    for (int n; (n = cq.poll(wc)) > 0;) out.insert(out.end(), wc, wc + n);
    return out;
  }
};

TEST(VerbsFakeRc, WriteWithImmMovesBytesAndConsumesAReceive) {
  RcPair p;
  p.post_imm_recvs(2);
  WriteChain c(p.remote(), p.qa->caps(), 8);
  c.add(p.op(100, 0, 10, std::nullopt));      // plain write, not inline
  c.add(p.op(8, 100, 200, 0x01020304u));       // inline, with imm
  p.qa->post_send(c.finish(std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(p.fa().outstanding, 2u);
  p.fabric.progress();
  for (int i = 0; i < 100; ++i) ASSERT_EQ(p.dst[10 + i], p.src[i]) << i;
  for (int i = 0; i < 8; ++i) ASSERT_EQ(p.dst[200 + i], p.src[100 + i]) << i;
  EXPECT_EQ(p.dst[9], 0);
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 1u);  // only the signaled (last) WR completes
  EXPECT_EQ(sent[0].wr_id, 2u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(p.fa().outstanding, 0u);  // and frees both slots
  const auto got = p.drain(*p.cb);
  ASSERT_EQ(got.size(), 1u);  // the plain write consumed no receive
  EXPECT_EQ(got[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(got[0].wc_flags & IBV_WC_WITH_IMM, unsigned{IBV_WC_WITH_IMM});
  EXPECT_EQ(got[0].imm_data, htonl(0x01020304u));  // wire order, as posted
  EXPECT_EQ(got[0].wr_id, 500u);
  EXPECT_EQ(got[0].byte_len, 8u);
  EXPECT_EQ(p.fb().unconsumed_recvs(), 1u);
}

TEST(VerbsFakeRc, NoReceiveIsRnrUntilOneIsPostedOrRetriesRunOut) {
  RcPair p;
  WriteChain c(p.remote(), p.qa->caps(), 8);
  c.add(p.op(4, 0, 0, 7u));
  p.qa->post_send(c.finish(1));
  p.fabric.progress();
  p.fabric.progress();
  EXPECT_EQ(p.fabric.rnr_naks, 2u);
  EXPECT_TRUE(p.drain(*p.ca).empty());
  EXPECT_EQ(p.dst[0], 0);  // nothing placed while RNR
  p.post_imm_recvs(1);
  p.fabric.progress();
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(p.dst[0], p.src[0]);

  RcPair q;
  q.fabric.rnr_retry_passes = 3;
  WriteChain c2(q.remote(), q.qa->caps(), 8);
  c2.add(q.op(4, 0, 0, 7u));
  q.qa->post_send(c2.finish(9));
  for (int i = 0; i < 5; ++i) q.fabric.progress();
  const auto failed = q.drain(*q.ca);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(failed[0].wr_id, 9u);
  EXPECT_EQ(q.fa().state(), QpState::kError);
}

TEST(VerbsFakeRc, BadRkeyFailsThatWrAndFlushesTheRestEachWithACompletion) {
  RcPair p;
  p.post_imm_recvs(3);
  RemoteBuffer bad = p.remote();
  bad.rkey ^= 0x10;
  WriteChain c(p.remote(), p.qa->caps(), 8);
  c.add(p.op(4, 0, 0, 1u));
  c.add(p.op(4, 0, 8, 2u), bad);
  c.add(p.op(4, 0, 16, 3u));
  p.qa->post_send(c.finish(std::vector<uint64_t>{11, 12, 13}));
  p.fabric.progress();
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 2u);  // WR 11 succeeded unsignaled: no completion
  EXPECT_EQ(sent[0].wr_id, 12u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_NE(sent[0].opcode, IBV_WC_RDMA_WRITE);  // undefined on errors
  EXPECT_EQ(sent[1].wr_id, 13u);
  EXPECT_EQ(sent[1].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(p.fa().state(), QpState::kError);
  EXPECT_EQ(p.dst[0], p.src[0]);
  EXPECT_EQ(p.dst[16], 0);  // never executed
  EXPECT_EQ(p.drain(*p.cb).size(), 1u);  // only the first write's immediate
  EXPECT_THROW(p.qa->post_send(c.finish(14)), FabricError);  // ERROR: no more sends
}

TEST(VerbsFakeRc, ErrorQpFlushesItsPostedReceives) {
  RcPair p;
  p.post_imm_recvs(3);
  p.fb().to_error();
  p.fabric.progress();
  const auto got = p.drain(*p.cb);
  ASSERT_EQ(got.size(), 3u);
  for (const auto& wc : got) EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

TEST(VerbsFakeRc, SendScattersIntoTheReceiveOrFailsBothSidesWhenTooLong) {
  RcPair p;
  std::vector<char> slot(16, 0);
  auto slot_mr = p.db.register_memory(slot.data(), slot.size());
  RecvChain rc(4);
  p.qb->post_recv(rc.slots(reinterpret_cast<uint64_t>(slot.data()), slot_mr->lkey(), 8, 2, 0, 2));
  ibv_send_wr wr;
  ibv_sge sge;
  p.qa->post_send(fill_send(wr, sge, reinterpret_cast<uint64_t>(p.src.data()), p.src_mr->lkey(),
                            6, 0, 21));
  p.fabric.progress();
  auto got = p.drain(*p.cb);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(got[0].byte_len, 6u);
  EXPECT_EQ(std::memcmp(slot.data(), p.src.data(), 6), 0);
  p.qa->post_send(fill_send(wr, sge, reinterpret_cast<uint64_t>(p.src.data()), p.src_mr->lkey(),
                            9, 0, 22));
  p.fabric.progress();
  got = p.drain(*p.cb);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, IBV_WC_LOC_LEN_ERR);
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[1].status, IBV_WC_REM_INV_REQ_ERR);
}

TEST(VerbsFakeRc, MismatchedPsnIsRetryExceeded) {
  RcPair p(100, 200, /*b_expects=*/101);
  p.post_imm_recvs(1);
  WriteChain c(p.remote(), p.qa->caps(), 8);
  c.add(p.op(4, 0, 0, 1u));
  p.qa->post_send(c.finish(1));
  p.fabric.progress();
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(p.dst[0], 0);
}

TEST(VerbsFakeRc, UnregisteredSourceIsLocalProtectionError) {
  RcPair p;
  p.post_imm_recvs(1);
  std::vector<uint8_t> stray(64, 1);
  WriteChain c(p.remote(), p.qa->caps(), 8);
  c.add({reinterpret_cast<uint64_t>(stray.data()), p.src_mr->lkey(), 64, 0, 1u});
  p.qa->post_send(c.finish(1));
  p.fabric.progress();
  const auto sent = p.drain(*p.ca);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_LOC_PROT_ERR);
}

}  // namespace
}  // namespace moelink::fabric::verbs
