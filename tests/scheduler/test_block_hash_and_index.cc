// moelink block hash v1 (pinned values, shared with tests/python/
// test_scheduler_clients.py) and the prefix index.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "moelink/scheduler/block_hash.h"
#include "scheduler/core/prefix_index.h"

namespace moelink::scheduler {
namespace {

std::vector<uint32_t> pinned_tokens() {
  std::vector<uint32_t> t;
  for (uint32_t i = 0; i < 40; ++i) t.push_back(i * 7 + 3);
  return t;
}

TEST(BlockHash, PinnedValues) {
  // The Python client computes the same; a change here breaks every engine
  // that publishes moelink hashes.
  const auto h = prompt_block_hashes(pinned_tokens(), 16);
  ASSERT_EQ(h.size(), 2u);  // 40 tokens: two full blocks, the partial one has no hash
  EXPECT_EQ(h[0], 0x841266545bfe497bull);
  EXPECT_EQ(h[1], 0xf99bafcc168bf13aull);
  const uint32_t one[] = {42};
  EXPECT_EQ(block_hash(kRootBlockHash, one), 0xeca23b8ee35431b7ull);
}

TEST(BlockHash, ChainsThePrefix) {
  std::mt19937 rng(std::random_device{}());
  std::vector<uint32_t> a(64), b;
  for (auto& t : a) t = rng();
  b = a;
  b[5] ^= 1;  // differs in block 0 only
  const auto ha = prompt_block_hashes(a, 16), hb = prompt_block_hashes(b, 16);
  for (size_t i = 0; i < ha.size(); ++i) EXPECT_NE(ha[i], hb[i]) << "block " << i;
  b = a;
  b[40] ^= 1;  // block 2
  const auto hc = prompt_block_hashes(b, 16);
  EXPECT_EQ(ha[0], hc[0]);
  EXPECT_EQ(ha[1], hc[1]);
  EXPECT_NE(ha[2], hc[2]);
  EXPECT_NE(ha[3], hc[3]);
  EXPECT_THROW(prompt_block_hashes(a, 0), std::invalid_argument);
}

EngineSet all(int n) {
  EngineSet s;
  for (int i = 0; i < n; ++i) s.set(i);
  return s;
}

TEST(PrefixIndex, MatchesLeadingBlocksPerEngine) {
  PrefixIndex idx;
  const std::vector<uint64_t> h = {11, 22, 33, 44};
  idx.store(0, 11);
  idx.store(0, 22);
  idx.store(0, 33);
  idx.store(1, 11);
  idx.store(2, 22);  // no block 0: holds no prefix
  idx.store(200, 11);
  idx.store(200, 22);
  idx.store(200, 33);
  idx.store(200, 44);
  EngineSet engines = all(3);
  engines.set(200);
  std::vector<uint32_t> m;
  idx.match(h, engines, m);
  EXPECT_EQ(m[0], 3u);
  EXPECT_EQ(m[1], 1u);
  EXPECT_EQ(m[2], 0u);
  EXPECT_EQ(m[200], 4u);
  EXPECT_EQ(m[3], 0u);
  EXPECT_EQ(idx.confirmed_blocks(0), 3u);
  idx.remove(0, 22);  // a hole: only block 0 still matches
  idx.match(h, engines, m);
  EXPECT_EQ(m[0], 1u);
  idx.clear(200);
  idx.match(h, engines, m);
  EXPECT_EQ(m[200], 0u);
  EXPECT_EQ(idx.confirmed_blocks(200), 0u);
  // Engines outside the candidate set are not reported.
  idx.match(h, all(1), m);
  EXPECT_EQ(m[1], 0u);
}

TEST(PrefixIndex, ProvisionalEntriesExpireUnlessConfirmed) {
  PrefixIndex idx;
  const auto t0 = Clock::now();
  const std::vector<uint64_t> h = {1, 2, 3};
  idx.add_provisional(4, h, t0 + std::chrono::seconds(1));
  std::vector<uint32_t> m;
  idx.match(h, all(8), m);
  EXPECT_EQ(m[4], 3u);
  idx.store(4, 1);  // the engine confirmed block 0 only
  idx.expire(t0 + std::chrono::seconds(2));
  idx.match(h, all(8), m);
  EXPECT_EQ(m[4], 1u);
  EXPECT_EQ(idx.entries(), 1u);
  // A removal clears a provisional mark at once.
  idx.add_provisional(5, h, t0 + std::chrono::seconds(10));
  idx.remove(5, 1);
  idx.match(h, all(8), m);
  EXPECT_EQ(m[5], 0u);
}

TEST(PrefixIndex, RandomAgainstBruteForce) {
  std::mt19937_64 rng(std::random_device{}());
  PrefixIndex idx;
  std::vector<std::set<uint64_t>> truth(16);
  for (int op = 0; op < 20000; ++op) {
    const int e = static_cast<int>(rng() % 16);
    const uint64_t h = rng() % 64;
    if (rng() % 3) {
      idx.store(e, h);
      truth[e].insert(h);
    } else {
      idx.remove(e, h);
      truth[e].erase(h);
    }
  }
  std::vector<uint32_t> m;
  for (int q = 0; q < 200; ++q) {
    std::vector<uint64_t> hashes(rng() % 12);
    for (auto& h : hashes) h = rng() % 64;
    idx.match(hashes, all(16), m);
    for (int e = 0; e < 16; ++e) {
      uint32_t want = 0;
      while (want < hashes.size() && truth[e].count(hashes[want])) ++want;
      ASSERT_EQ(m[e], want) << "engine " << e;
    }
  }
}

}  // namespace
}  // namespace moelink::scheduler
