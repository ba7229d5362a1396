// KvCacheManager: prefix sharing by the scheduler's block hash, the events
// its index takes, eviction order, refusals that change nothing, and a
// random soak checked against the invariants after every operation.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "engine/kv_cache_manager.h"
#include "moelink/scheduler/block_hash.h"

namespace moelink::engine {
namespace {

std::vector<uint32_t> tokens(int n, uint32_t first) {
  std::vector<uint32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = first + i;
  return t;
}

// Runs a request's prompt through: admit, reserve, commit all of it.
int64_t prefill(KvCacheManager& m, uint64_t id, const std::vector<uint32_t>& prompt) {
  const int64_t cached = m.admit(id, prompt);
  EXPECT_TRUE(m.reserve(id, static_cast<int64_t>(prompt.size())));
  m.commit(id, prompt, static_cast<int64_t>(prompt.size()));
  return cached;
}

TEST(KvCacheManager, SharedPrefixesShareTheirFullPagesAndTheEventsAreTheSchedulersHashes) {
  KvCacheManager m(16, 4);
  std::vector<uint32_t> a = tokens(10, 100);  // pages 0, 1 full; 2 tokens in a third
  EXPECT_EQ(prefill(m, 1, a), 0);
  std::vector<KvEvent> ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEvent::kStored);
  EXPECT_FALSE(ev[0].parent.has_value());
  EXPECT_EQ(ev[0].hashes, scheduler::prompt_block_hashes(a, 4)) << "the scheduler's own hashes";
  // b shares a's first 8 tokens, then differs.
  std::vector<uint32_t> b = a;
  b[9] = 7;
  b.push_back(8);
  b.push_back(9);
  EXPECT_EQ(m.admit(2, b), 8);
  EXPECT_EQ(std::vector<int32_t>(m.pages(2).begin(), m.pages(2).end()),
            std::vector<int32_t>(m.pages(1).begin(), m.pages(1).begin() + 2));
  ASSERT_TRUE(m.reserve(2, 12));
  EXPECT_NE(m.pages(2)[2], m.pages(1)[2]) << "a partial page is never shared";
  m.commit(2, b, 12);
  ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].parent, scheduler::prompt_block_hashes(a, 4)[1]) << "the chain goes on after a's pages";
  EXPECT_EQ(ev[0].hashes, std::vector<uint64_t>{scheduler::prompt_block_hashes(b, 4)[2]});
  m.check_invariants();
  // A whole prompt cached: its last token is still computed.
  EXPECT_EQ(m.admit(3, std::vector<uint32_t>(b.begin(), b.begin() + 12)), 8);
  EXPECT_EQ(m.admit(4, std::vector<uint32_t>(b.begin(), b.begin() + 13)), 12);
  EXPECT_THROW(m.admit(4, b), std::invalid_argument);
  m.check_invariants();
}

TEST(KvCacheManager, WithoutPrefixCachingNothingIsSharedNamedOrKept) {
  KvCacheManager m(6, 4, /*prefix_caching=*/false);
  EXPECT_FALSE(m.prefix_caching());
  const std::vector<uint32_t> a = tokens(10, 100);
  EXPECT_EQ(prefill(m, 1, a), 0);
  EXPECT_EQ(prefill(m, 2, a), 0) << "the same prompt again shares nothing";
  const std::set<int32_t> first(m.pages(1).begin(), m.pages(1).end());
  for (int32_t p : m.pages(2)) EXPECT_EQ(first.count(p), 0u) << "page " << p << " held by both";
  EXPECT_TRUE(m.take_events().empty());
  EXPECT_EQ(m.cached_pages(), 0);
  EXPECT_EQ(m.available_pages(), 0);
  m.check_invariants();
  m.release(1);
  m.release(2);
  EXPECT_EQ(m.available_pages(), 6) << "released pages are free again";
  EXPECT_EQ(m.cached_pages(), 0);
  EXPECT_EQ(prefill(m, 3, a), 0);
  m.check_invariants();
}

TEST(KvCacheManager, ReleasedPagesStayCachedAndTheLeastRecentlyUsedGoFirst) {
  KvCacheManager m(4, 2);
  const std::vector<uint32_t> a = tokens(4, 0), b = tokens(4, 50);
  prefill(m, 1, a);
  prefill(m, 2, b);
  m.release(1);
  m.release(2);
  m.take_events();
  EXPECT_EQ(m.available_pages(), 4);
  EXPECT_EQ(m.cached_pages(), 4);
  // Touch a again: b is now the least recently used.
  EXPECT_EQ(m.admit(3, tokens(5, 0)), 4);
  m.release(3);
  // A new prompt of two pages evicts b's two.
  prefill(m, 4, tokens(4, 900));
  std::vector<KvEvent> ev = m.take_events();
  ASSERT_GE(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEvent::kRemoved);
  std::vector<uint64_t> removed = ev[0].hashes;
  std::sort(removed.begin(), removed.end());
  std::vector<uint64_t> bh = scheduler::prompt_block_hashes(b, 2);
  std::sort(bh.begin(), bh.end());
  EXPECT_EQ(removed, bh);
  EXPECT_EQ(m.admit(5, tokens(5, 0)), 4) << "a's pages survived";
  m.check_invariants();
}

TEST(KvCacheManager, AReservationThatDoesNotFitChangesNothing) {
  KvCacheManager m(3, 4);
  m.admit(1, tokens(8, 0));
  ASSERT_TRUE(m.reserve(1, 8));
  m.admit(2, tokens(8, 100));
  EXPECT_FALSE(m.reserve(2, 8));
  EXPECT_TRUE(m.pages(2).empty());
  EXPECT_EQ(m.available_pages(), 1);
  EXPECT_TRUE(m.reserve(2, 4));
  m.release(1);
  EXPECT_TRUE(m.reserve(2, 8)) << "released pages are free again";
  m.release(7);  // unknown: ignored
  m.check_invariants();
}

TEST(KvCacheManager, ClearDropsWhatNoRequestHolds) {
  KvCacheManager m(8, 2);
  prefill(m, 1, tokens(4, 0));
  prefill(m, 2, tokens(4, 10));
  m.release(1);
  m.take_events();
  m.clear(false);
  std::vector<KvEvent> ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].hashes.size(), 2u);
  EXPECT_EQ(m.cached_pages(), 2) << "request 2 still holds its pages";
  bool all = false;
  m.clear(true);
  EXPECT_TRUE(m.take_events(&all).empty());
  EXPECT_TRUE(all);
  EXPECT_EQ(m.cached_pages(), 0);
  m.check_invariants();
}

// Random admits, growth, commits and releases of prompts from a few shared
// stems; the invariants hold after every operation, and what the events
// say is cached is exactly what the cache holds.
TEST(KvCacheManager, RandomSoakKeepsTheInvariants) {
  std::mt19937_64 rng(std::random_device{}());
  KvCacheManager m(64, 4);
  std::map<uint64_t, std::vector<uint32_t>> live;
  std::set<uint64_t> indexed;  // the scheduler's view, from the events
  uint64_t next = 1;
  for (int op = 0; op < 3000; ++op) {
    const int kind = static_cast<int>(rng() % 3);
    if (kind == 0 || live.empty()) {
      const uint32_t stem = static_cast<uint32_t>(rng() % 4) * 1000;
      std::vector<uint32_t> p = tokens(static_cast<int>(4 + rng() % 20), stem);
      for (size_t i = 8 + rng() % 8; i < p.size(); ++i) p[i] = static_cast<uint32_t>(rng() % 50);
      const uint64_t id = next++;
      const int64_t cached = m.admit(id, p);
      EXPECT_LT(cached, static_cast<int64_t>(p.size()));
      if (m.reserve(id, static_cast<int64_t>(p.size()))) {
        m.commit(id, p, static_cast<int64_t>(p.size()));
        live[id] = p;
      } else {
        m.release(id);
      }
    } else if (kind == 1) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      it->second.push_back(static_cast<uint32_t>(rng() % 50));  // a decoded token
      if (m.reserve(it->first, static_cast<int64_t>(it->second.size()))) {
        m.commit(it->first, it->second, static_cast<int64_t>(it->second.size()));
      } else {
        it->second.pop_back();
      }
    } else {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      m.release(it->first);
      live.erase(it);
    }
    for (const KvEvent& e : m.take_events()) {
      if (e.kind == KvEvent::kRemoved) {
        for (uint64_t h : e.hashes) ASSERT_EQ(indexed.erase(h), 1u) << "removed a hash never stored";
        continue;
      }
      if (e.parent) {
        ASSERT_TRUE(indexed.count(*e.parent)) << "stored after an unknown parent";
      }
      for (uint64_t h : e.hashes) ASSERT_TRUE(indexed.insert(h).second) << "stored twice";
    }
    ASSERT_NO_THROW(m.check_invariants()) << "after operation " << op;
    ASSERT_EQ(static_cast<int64_t>(indexed.size()), m.cached_pages());
  }
}

}  // namespace
}  // namespace moelink::engine
