// The real TransferEngine over the verbs transport, 2-3 engines in one
// process on fake devices (verbs_engine_harness.h): every operation end to
// end through the public API, checking bytes, immediate counts and error
// texts, plus what only the fake can show (doorbells, RNR counts).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fabric/verbs/verbs_address.h"
#include "moelink/errors.h"
#include "moelink/fabric_errors.h"
#include "verbs_engine_harness.h"

namespace {

using namespace moelink::fabric;
using moelink_test::FakeVerbsCluster;
using moelink_test::FakeVerbsEngine;
namespace fake = moelink::fabric::verbs::fake;

uint8_t pattern(int who, size_t i) { return static_cast<uint8_t>(who * 31 + i * 7 + 1); }

// The write QP to a device's peer number `peer` (its RC QPs are made in
// pairs, message QP first; the UD QP comes before them).
const fake::FakeQp& write_qp(const fake::FakeDevice& dev, size_t peer) {
  std::vector<const fake::FakeQp*> rc;
  for (const fake::FakeQp* q : dev.qps)
    if (q->type() == moelink::fabric::verbs::QpType::kRc) rc.push_back(q);
  return *rc.at(2 * peer + 1);
}

template <typename E>
void expect_throw_naming(const std::function<void()>& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    for (const auto& w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
          << "'" << w << "' missing in: " << e.what();
  }
}

// One engine's buffers: a patterned source and a zeroed target, registered.
struct Side {
  std::vector<uint8_t> src, dst;
  MemoryRegion rs, rd;
  Side(TransferEngine& e, int who, size_t n) : src(n), dst(n, 0) {
    for (size_t i = 0; i < n; ++i) src[i] = pattern(who, i);
    rs = e.register_memory(src.data(), src.size());
    rd = e.register_memory(dst.data(), dst.size());
  }
};

TEST(VerbsEngine, ReportsItsTransport) {
  FakeVerbsCluster c;
  auto a = c.make("a", 2);
  EXPECT_EQ(a->provider(), "ibverbs");
  EXPECT_EQ(a->num_domains(), 2);
  EXPECT_FALSE(a->hmem());
  ASSERT_EQ(a->address().endpoints.size(), 2u);
  EXPECT_EQ(verbs::decode_endpoint(a->address().endpoints[1], "a").node, a.nics[1]->node_id());
}

TEST(VerbsEngine, WriteWithImmediateBothWays) {
  FakeVerbsCluster c;
  FakeVerbsEngine e[2] = {c.make("rank0"), c.make("rank1")};
  Side s0(*e[0].engine, 0, 1 << 16), s1(*e[1].engine, 1, 1 << 16);
  const MemoryDescriptor d[2] = {e[0]->descriptor(s0.rd), e[1]->descriptor(s1.rd)};
  // Descriptors carry the virtual address and the rkey of each domain.
  EXPECT_EQ(d[1].remote_base.at(0), reinterpret_cast<uint64_t>(s1.dst.data()));
  std::atomic<int> called{0};
  auto t0 = e[0]->write(s0.rs, 24, d[1], 100, 1000, 7u);
  auto t1 = e[1]->write(s1.rs, 0, d[0], 4096, 60000, 8u, [&](std::exception_ptr err) {
    if (!err) called++;
  });
  t0->wait();
  t1->wait();
  EXPECT_EQ(called.load(), 1);
  e[1]->wait_imm(7, 1);
  e[0]->wait_imm(8, 1);
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(s1.dst[100 + i], pattern(0, 24 + i)) << i;
  for (size_t i = 0; i < 60000; ++i) ASSERT_EQ(s0.dst[4096 + i], pattern(1, i)) << i;
  EXPECT_EQ(s1.dst[99], 0);
  EXPECT_EQ(s1.dst[1100], 0);
  EXPECT_EQ(e[1]->imm_count(7), 0u) << "wait_imm did not consume";
  EXPECT_EQ(c.fabric.rnr_naks, 0u) << "receives must be posted before peers can write";
}

TEST(VerbsEngine, PagedWriteWithStridesOverTwoDomains) {
  FakeVerbsCluster c;
  auto a = c.make("prefill", 2);
  auto b = c.make("decode", 2);
  constexpr size_t kPage = 256, kSrcStride = 512, kDstStride = 384, kPages = 16;
  std::vector<uint8_t> src(kSrcStride * kPages), dst(64 + kDstStride * kPages, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(0, i);
  auto rs = a->register_memory(src.data(), src.size());
  auto rd = b->register_memory(dst.data(), dst.size());
  const MemoryDescriptor d = b->descriptor(rd);
  ASSERT_EQ(d.keys.size(), 2u);
  EXPECT_NE(d.keys[0], d.keys[1]) << "one rkey per domain (device)";
  PagedWrite p;
  p.page_bytes = kPage;
  p.src_stride = kSrcStride;
  p.dst_stride = kDstStride;
  p.dst_offset = 64;
  for (size_t i = 0; i < 10; ++i) {
    p.src_pages.push_back(9 - i);
    p.dst_pages.push_back((3 * i) % kPages);
  }
  a->paged_write(rs, d, p, 21u)->wait();
  b->wait_imm(21, p.src_pages.size());
  for (size_t i = 0; i < p.src_pages.size(); ++i)
    for (size_t j = 0; j < kPage; ++j)
      ASSERT_EQ(dst[64 + p.dst_pages[i] * kDstStride + j], pattern(0, p.src_pages[i] * kSrcStride + j))
          << "page " << i << " byte " << j;
  // Pages were sharded over both NICs: each device's write QP carried some.
  for (fake::FakeDevice* dev : a.devices) {
    fake::FakeLock lock(fake::fake_mutex());
    size_t writes = 0;
    for (fake::FakeQp* q : dev->qps)
      for (const auto& s : q->sends) writes += s.wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    EXPECT_EQ(writes, 5u) << dev->name();
  }
}

TEST(VerbsEngine, ScatterAndBarrierToAGroupOfThreeRounds) {
  for (int domains : {1, 2}) {
    SCOPED_TRACE("domains " + std::to_string(domains));
    FakeVerbsCluster c;
    constexpr int kRanks = 3;
    constexpr size_t kSlice = 500;
    std::vector<FakeVerbsEngine> e;
    for (int r = 0; r < kRanks; ++r) e.push_back(c.make("rank" + std::to_string(r), domains));
    std::vector<std::unique_ptr<Side>> s;
    std::vector<MemoryDescriptor> d;
    for (int r = 0; r < kRanks; ++r) {
      s.push_back(std::make_unique<Side>(*e[r].engine, r, kSlice * kRanks * 2));
      d.push_back(e[r]->descriptor(s[r]->rd));
    }
    std::vector<GroupId> g(kRanks);
    std::vector<std::vector<int>> members(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      std::vector<MemoryDescriptor> others;
      for (int q = 0; q < kRanks; ++q)
        if (q != r) {
          others.push_back(d[q]);
          members[r].push_back(q);
        }
      g[r] = e[r]->add_peer_group(others);
    }
    for (int round = 0; round < 3; ++round) {
      std::vector<TransferPtr> t;
      for (int r = 0; r < kRanks; ++r) {
        std::vector<ScatterSlice> slices;
        for (size_t m = 0; m < members[r].size(); ++m) {
          // Two slices per member: to this rank's block of the member's dst.
          const uint64_t at = static_cast<uint64_t>(r) * 2 * kSlice;
          slices.push_back({m, m * kSlice, at, kSlice});
          slices.push_back({m, (m + 2) * kSlice, at + kSlice, kSlice});
        }
        t.push_back(e[r]->scatter(g[r], s[r]->rs, slices, 100 + round));
      }
      for (auto& x : t) x->wait();
      for (int r = 0; r < kRanks; ++r) t.push_back(e[r]->barrier(g[r], 200 + round));
      for (int r = 0; r < kRanks; ++r) {
        e[r]->wait_imm(100 + round, 2 * (kRanks - 1));  // two slices from each peer
        e[r]->wait_imm(200 + round, kRanks - 1);
      }
      for (auto& x : t) x->wait();
      for (int r = 0; r < kRanks; ++r)
        for (int q = 0; q < kRanks; ++q) {
          if (q == r) continue;
          const size_t m = static_cast<size_t>(r < q ? r : r - 1);  // r's index in q's group
          const uint8_t* blk = s[r]->dst.data() + static_cast<size_t>(q) * 2 * kSlice;
          for (size_t i = 0; i < kSlice; ++i) {
            ASSERT_EQ(blk[i], pattern(q, m * kSlice + i)) << "rank " << r << " from " << q;
            ASSERT_EQ(blk[kSlice + i], pattern(q, (m + 2) * kSlice + i));
          }
        }
      for (int r = 0; r < kRanks; ++r) EXPECT_EQ(e[r]->imm_count(100 + round), 0u);
    }
  }
}

TEST(VerbsEngine, WaitImmCountsAndTimesOutNamingWhatArrived) {
  FakeVerbsCluster c;
  auto a = c.make("a");
  auto b = c.make("b");
  Side sa(*a.engine, 0, 4096), sb(*b.engine, 1, 4096);
  const MemoryDescriptor db = b->descriptor(sb.rd);
  for (int i = 0; i < 5; ++i) a->write(sa.rs, 0, db, 0, 16, 0xabcdef01u)->wait();
  b->wait_imm(0xabcdef01u, 3);
  // A write's local completion does not mean the target counted it yet: the
  // failing wait gives the last two time to arrive, and consumes nothing.
  expect_throw_naming<moelink::TimeoutError>([&] { b->wait_imm(0xabcdef01u, 4, 0.2); },
                                              {"immediate " + std::to_string(0xabcdef01u),
                                               "arrived 2 of 4 times"});
  EXPECT_EQ(b->imm_count(0xabcdef01u), 2u);
  b->wait_imm(0xabcdef01u, 2);
  EXPECT_EQ(b->imm_count(0xabcdef01u), 0u);
}

TEST(VerbsEngine, SendAndReceiveMoreMessagesThanReceiveBuffers) {
  FakeVerbsCluster c;
  auto tweak = [](EngineOptions& o) {
    o.recv_buffers = 4;
    o.max_message_bytes = 128;
  };
  auto a = c.make("a", 1, 10.0, tweak);
  auto b = c.make("b", 1, 10.0, tweak);
  std::vector<char> ma(128 * 20), mb(128);
  auto ra = a->register_memory(ma.data(), ma.size());
  auto rb = b->register_memory(mb.data(), mb.size());
  const PeerId to_b = a->add_peer(b->address());
  const PeerId to_a = b->add_peer(a->address());
  std::vector<TransferPtr> t;
  for (int i = 0; i < 20; ++i) {
    const int n = std::snprintf(ma.data() + 128 * i, 128, "message %02d from a", i);
    t.push_back(a->send(to_b, ra, 128 * i, static_cast<size_t>(n)));
  }
  for (int i = 0; i < 20; ++i) {
    auto m = b->recv(5.0);
    ASSERT_TRUE(m.has_value()) << "message " << i;
    char want[64];
    std::snprintf(want, sizeof(want), "message %02d from a", i);
    EXPECT_EQ(std::string(m->data.begin(), m->data.end()), want);
  }
  for (auto& x : t) x->wait();
  std::memcpy(mb.data(), "pong", 4);
  b->send(to_a, rb, 0, 4)->wait();
  auto m = a->recv(5.0);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(std::string(m->data.begin(), m->data.end()), "pong");
  EXPECT_FALSE(b->recv(0.05).has_value());
  expect_throw_naming<moelink::InvalidArgument>([&] { a->send(to_b, ra, 0, 129); },
                                                 {"max_message_bytes"});
}

TEST(VerbsEngine, PagedWriteToOnePeerIsOneDoorbellWithOnlyTheLastSignaled) {
  FakeVerbsCluster c;
  auto a = c.make("a");
  auto b = c.make("b");
  Side sa(*a.engine, 0, 64 * 64), sb(*b.engine, 1, 64 * 64);
  const MemoryDescriptor db = b->descriptor(sb.rd);
  a->write(sa.rs, 0, db, 0, 8, 1u)->wait();  // connected
  b->wait_imm(1, 1);
  // 8 pages, then 40 pages (max_chain 32: 32 + 8).
  for (size_t pages : {size_t{8}, size_t{40}}) {
    PagedWrite p;
    p.page_bytes = 64;
    p.src_stride = p.dst_stride = 64;
    for (size_t i = 0; i < pages; ++i) {
      p.src_pages.push_back(i);
      p.dst_pages.push_back(pages - 1 - i);
    }
    const uint64_t before = a.nics[0]->write_doorbells();
    a->paged_write(sa.rs, db, p, 2u)->wait();
    b->wait_imm(2, pages);
    EXPECT_EQ(a.nics[0]->write_doorbells() - before, pages == 8 ? 1u : 2u) << pages << " pages";
    for (size_t i = 0; i < pages; ++i)
      ASSERT_EQ(std::memcmp(sb.dst.data() + 64 * (pages - 1 - i), sa.src.data() + 64 * i, 64), 0);
    fake::FakeLock lock(fake::fake_mutex());
    const auto& sends = write_qp(*a.devices[0], 0).sends;
    ASSERT_GE(sends.size(), pages);
    size_t signaled = 0;
    for (size_t i = sends.size() - pages; i < sends.size(); ++i)
      signaled += (sends[i].wr.send_flags & IBV_SEND_SIGNALED) != 0;
    EXPECT_EQ(signaled, pages == 8 ? 1u : 2u);
    if (pages == 8) {
      for (size_t i = sends.size() - 8; i < sends.size(); ++i)
        EXPECT_EQ(sends[i].call, sends.back().call);
    }
  }
}

TEST(VerbsEngine, APeerThatNeverAnswersTheHandshakeIsATimeoutNamingIt) {
  FakeVerbsCluster c;
  auto a = c.make("rank0", 1, /*timeout_s=*/0.5);
  MemoryDescriptor gone_desc;
  {
    auto ghost = c.make("ghost", 1, 0.5);
    std::vector<uint8_t> buf(64);
    gone_desc = ghost->descriptor(ghost->register_memory(buf.data(), buf.size()));
  }  // the ghost's NIC left the fabric: its UD QP answers nothing
  std::vector<uint8_t> src(64, 1);
  auto rs = a->register_memory(src.data(), src.size());
  const auto t0 = std::chrono::steady_clock::now();
  auto t = a->write(rs, 0, gone_desc, 0, 64, 3u);
  expect_throw_naming<moelink::TimeoutError>([&] { t->wait(); },
                                              {"write to peer 'ghost'", "verbs handshake",
                                               "peer 'ghost'", "no ACK"});
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 2.0) << "bounded by the engine timeout";
}

TEST(VerbsEngine, AnErrorCompletionFailsTheOperationNamingThePeer) {
  FakeVerbsCluster c;
  auto a = c.make("rank0");
  auto b = c.make("rank1");
  Side sa(*a.engine, 0, 4096), sb(*b.engine, 1, 4096);
  MemoryDescriptor db = b->descriptor(sb.rd);
  a->write(sa.rs, 0, db, 0, 8, 1u)->wait();
  MemoryDescriptor wrong = db;
  wrong.keys[0] ^= 0x40;  // an rkey the target never issued
  expect_throw_naming<moelink::FabricError>(
      [&] { a->write(sa.rs, 0, wrong, 0, 64, 2u)->wait(); },
      {"write to peer 'rank1'", "completion error", "IBV_WC_REM_ACCESS_ERR", "peer 'rank1'"});
  // The QPs are in error now: the next write fails at once, naming why.
  const auto t0 = std::chrono::steady_clock::now();
  expect_throw_naming<moelink::FabricError>([&] { a->write(sa.rs, 0, db, 0, 8, 3u)->wait(); },
                                             {"rank1", "IBV_WC_REM_ACCESS_ERR"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
}

TEST(VerbsEngine, APeerEngineThatWentAwayFailsWritesWithoutHanging) {
  FakeVerbsCluster c;
  c.fabric.retry_passes = 50;
  auto a = c.make("rank0", 1, 5.0);
  MemoryDescriptor db;
  std::vector<uint8_t> src(64, 1);
  auto rs = a->register_memory(src.data(), src.size());
  {
    auto b = c.make("rank1", 1, 5.0);
    std::vector<uint8_t> dst(64);
    db = b->descriptor(b->register_memory(dst.data(), dst.size()));
    a->write(rs, 0, db, 0, 8, 1u)->wait();
    b->wait_imm(1, 1);
  }
  expect_throw_naming<moelink::FabricError>([&] { a->write(rs, 0, db, 0, 8, 2u)->wait(); },
                                             {"rank1", "IBV_WC_RETRY_EXC_ERR"});
}

TEST(VerbsEngine, ThreadsWritingToOnePeerConcurrently) {
  FakeVerbsCluster c;
  auto a = c.make("a", 2);
  auto b = c.make("b", 2);
  constexpr int kThreads = 3, kWrites = 200;
  Side sa(*a.engine, 0, kThreads * kWrites * 8), sb(*b.engine, 1, kThreads * kWrites * 8);
  const MemoryDescriptor db = b->descriptor(sb.rd);
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; ++t)
    th.emplace_back([&, t] {
      std::vector<TransferPtr> ops;
      for (int i = 0; i < kWrites; ++i) {
        const uint64_t off = (static_cast<uint64_t>(t) * kWrites + i) * 8;
        ops.push_back(a->write(sa.rs, off, db, off, 8, 50u + t));
      }
      for (auto& o : ops) o->wait();
    });
  for (auto& t : th) t.join();
  for (int t = 0; t < kThreads; ++t) b->wait_imm(50u + t, kWrites);
  EXPECT_EQ(sb.dst, sa.src);
}

TEST(VerbsEngine, RejectsAddressesThatAreNotVerbsEndpoints) {
  FakeVerbsCluster c;
  auto a = c.make("a");
  EngineAddress tcp;
  tcp.name = "tcp-rank";
  tcp.endpoints = {std::string("\x02\x00\x1f\x90\x7f\x00\x00\x01", 8)};
  expect_throw_naming<moelink::InvalidArgument>([&] { a->add_peer(tcp); },
                                                 {"'tcp-rank'", "not an ibverbs endpoint"});
}

TEST(VerbsEngine, ProviderIbverbsWithoutADeviceIsUnavailable) {
  if (provider_available(kVerbsProvider))
    GTEST_SKIP() << "an RDMA device is present: this test covers machines without one";
  EngineOptions o;
  o.provider = kVerbsProvider;
  EXPECT_THROW(TransferEngine::create(o), moelink::ProviderUnavailable);
  o.verbs_devices = {"mlx5_does_not_exist"};
  EXPECT_THROW(TransferEngine::create(o), moelink::ProviderUnavailable);
}

}  // namespace
