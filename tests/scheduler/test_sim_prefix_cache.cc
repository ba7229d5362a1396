// moelink-engine-sim's KV cache (tools/scheduler/engine_sim/prefix_cache.h):
// deep chains are evictable as a whole once unpinned, pinned chains never,
// and a random run of pins, stores and reservations agrees with a plain
// model of which blocks can be given back.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "engine_sim/prefix_cache.h"

namespace moelink::scheduler::sim {
namespace {

// Stores `chain` (block i the parent of block i + 1) for one request: the
// blocks end pinned, as after a prefill.
void store_chain(PrefixCache& c, const std::vector<uint64_t>& chain) {
  std::vector<uint64_t> evicted;
  ASSERT_TRUE(c.reserve(chain.size(), evicted));
  for (size_t i = 0; i < chain.size(); ++i) c.store(chain[i], i > 0, i > 0 ? chain[i - 1] : 0);
}

TEST(SimPrefixCache, AnUnpinnedChainIsEvictableAsAWhole) {
  PrefixCache c(10);
  const std::vector<uint64_t> chain = {1, 2, 3, 4, 5, 6, 7, 8};
  store_chain(c, chain);
  EXPECT_EQ(c.evictable_blocks(), 0u);
  c.unpin(chain);
  // Only block 8 is a leaf now, yet all eight can be given back.
  EXPECT_EQ(c.evictable_blocks(), 8u);
  std::vector<uint64_t> evicted;
  ASSERT_TRUE(c.reserve(10, evicted));
  EXPECT_EQ(evicted, (std::vector<uint64_t>{8, 7, 6, 5, 4, 3, 2, 1}));  // leaves first
  EXPECT_EQ(c.cached_blocks(), 0u);
  EXPECT_EQ(c.free_blocks(), 0u);
}

TEST(SimPrefixCache, APinnedPrefixStaysAndAFailedReserveChangesNothing) {
  PrefixCache c(10);
  const std::vector<uint64_t> chain = {1, 2, 3, 4, 5, 6, 7, 8};
  store_chain(c, chain);
  c.unpin(chain);
  c.pin(std::vector<uint64_t>{1, 2, 3});  // a request using the first three
  EXPECT_EQ(c.evictable_blocks(), 5u);
  std::vector<uint64_t> evicted;
  EXPECT_FALSE(c.reserve(8, evicted));  // 2 free + 5 unpinned
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(c.cached_blocks(), 8u);
  ASSERT_TRUE(c.reserve(7, evicted));
  EXPECT_EQ(evicted, (std::vector<uint64_t>{8, 7, 6, 5, 4}));
  EXPECT_EQ(c.match(chain), 3u);
}

// Requests pin whole chains from the root (their cached prefix, then the
// blocks they store), as SimEngine does; a model counts pins per block.
TEST(SimPrefixCache, RandomRequestsAgreeWithAModel) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr uint64_t kCapacity = 64;
  PrefixCache c(kCapacity);
  // A small tree of prompts: block hash = path id, so prompts share prefixes.
  auto prompt = [&](int len) {
    std::vector<uint64_t> h;
    uint64_t id = 0;
    for (int i = 0; i < len; ++i) {
      id = id * 3 + 1 + rng() % 3;
      h.push_back(id);
    }
    return h;
  };
  std::vector<std::vector<uint64_t>> running;  // the blocks each running request pins
  std::map<uint64_t, int> pins;  // the model: every cached block and its pins
  for (int step = 0; step < 4000; ++step) {
    if (running.empty() || rng() % 2 == 0) {
      const auto h = prompt(1 + static_cast<int>(rng() % 12));
      const uint32_t m = c.match(h);
      c.pin(std::span<const uint64_t>(h.data(), m));
      for (uint32_t i = 0; i < m; ++i) ++pins.at(h[i]);
      const uint64_t need = h.size() - m;
      uint64_t unpinned = 0;
      for (const auto& [b, p] : pins) unpinned += p == 0;
      std::vector<uint64_t> evicted;
      const bool want = need <= c.free_blocks() + unpinned;
      ASSERT_EQ(c.reserve(need, evicted), want) << "step " << step;
      for (uint64_t e : evicted) {
        ASSERT_EQ(pins.at(e), 0) << "evicted a pinned block";
        pins.erase(e);
      }
      if (!want) {
        c.unpin(std::span<const uint64_t>(h.data(), m));
        for (uint32_t i = 0; i < m; ++i) --pins.at(h[i]);
        continue;
      }
      for (size_t i = m; i < h.size(); ++i) {
        c.store(h[i], i > 0, i > 0 ? h[i - 1] : 0);
        pins[h[i]] += 1;
      }
      running.push_back(h);
    } else {
      const size_t i = rng() % running.size();
      c.unpin(running[i]);
      for (uint64_t b : running[i]) --pins.at(b);
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
    }
    uint64_t unpinned = 0;
    for (const auto& [b, p] : pins) unpinned += p == 0;
    ASSERT_EQ(c.evictable_blocks(), unpinned) << "step " << step;
    ASSERT_EQ(c.cached_blocks(), pins.size()) << "step " << step;
  }
}

}  // namespace
}  // namespace moelink::scheduler::sim
