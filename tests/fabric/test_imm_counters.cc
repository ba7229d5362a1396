// ImmCounters (the engine's immediate counters) against a plain map, in one
// process: the lock-free table, its overflow map, concurrent adders and
// waiters, and signals.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <algorithm>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "fabric/imm_counters.h"
#include "moelink/errors.h"

namespace {

using moelink::fabric::ImmCounters;

// Random batches over more distinct immediates than the table holds (so
// the overflow map is used), with consumes; every count checked against
// a std::map after every batch.
TEST(FabricImmCounters, MatchAMapPastTheTablesSize) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  ImmCounters c;
  std::map<uint32_t, uint64_t> model;
  const size_t distinct = ImmCounters::kSlots + ImmCounters::kSlots / 2;
  std::vector<uint32_t> imms;
  // Clustered values (kind << 24 | rank, as the inter-node protocol makes
  // them) and random ones.
  for (uint32_t kind = 0; imms.size() < distinct / 2; ++kind)
    for (uint32_t rank = 0; rank < 512 && imms.size() < distinct / 2; ++rank)
      imms.push_back(kind << 24 | rank);
  while (imms.size() < distinct) imms.push_back(static_cast<uint32_t>(rng()));
  std::shuffle(imms.begin(), imms.end(), rng);
  for (size_t batch = 0; batch < distinct / 64; ++batch) {
    std::vector<std::pair<uint32_t, uint64_t>> adds;
    for (int i = 0; i < 96; ++i) {
      const uint32_t imm = imms[(batch * 64 + rng() % 96) % imms.size()];
      const uint64_t n = 1 + rng() % 3;
      adds.emplace_back(imm, n);
      model[imm] += n;
    }
    c.add(adds);
    // Consume some of what is there (wait returns at once).
    const uint32_t imm = adds[rng() % adds.size()].first;
    const uint64_t take = 1 + rng() % model[imm];
    c.wait(imm, take, 1.0);
    model[imm] -= take;
    for (const auto& [i, n] : adds) ASSERT_EQ(c.get(i), model[i]) << "immediate " << i;
  }
  for (const auto& [i, n] : model) ASSERT_EQ(c.get(i), n) << "immediate " << i;
  EXPECT_EQ(c.get(0xFFFFFFFFu), model.count(0xFFFFFFFFu) ? model[0xFFFFFFFFu] : 0u);
}

// Adders on several threads against waiters that consume in pieces, some
// of them asleep (no progress function): every arrival is consumed once.
TEST(FabricImmCounters, ConcurrentAddersAndWaitersConsumeEveryArrival) {
  ImmCounters c;
  constexpr int kAdders = 3, kPerAdder = 20000;
  constexpr uint32_t kImms[] = {7, 1u << 24 | 3, 0xFFFFFFFFu};
  std::vector<std::thread> threads;
  for (int a = 0; a < kAdders; ++a)
    threads.emplace_back([&, a] {
      for (int i = 0; i < kPerAdder; ++i)
        c.add({{kImms[(a + i) % 3], 1}, {kImms[(a + i + 1) % 3], 1}});
    });
  // Each immediate receives 2 * kAdders * kPerAdder / 3 arrivals in all.
  const uint64_t each = 2ull * kAdders * kPerAdder / 3;
  for (uint32_t imm : kImms)
    threads.emplace_back([&, imm] {
      for (uint64_t got = 0; got < each; got += 100) c.wait(imm, 100, 30.0);
    });
  for (auto& t : threads) t.join();
  for (uint32_t imm : kImms) EXPECT_EQ(c.get(imm), 0u) << "immediate " << imm;
}

TEST(FabricImmCounters, WaitTimesOutNamingTheCounts) {
  ImmCounters c;
  c.add({{5, 2}});
  try {
    c.wait(5, 3, 0.05);
    FAIL() << "no timeout";
  } catch (const moelink::TimeoutError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("immediate 5 arrived 2 of 3"), std::string::npos) << m;
  }
  EXPECT_EQ(c.get(5), 2u);  // a timed-out wait consumes nothing
}

// Signals fire in the add that completes them, also from another thread,
// and consume what they count.
TEST(FabricImmCounters, SignalsFireOnceTheirCountArrives) {
  ImmCounters c;
  uint64_t flag = 0, early = 0;
  c.add({{9, 1}});
  c.signal(9, 1, &early, 4);  // already there: at once
  EXPECT_EQ(early, 4u);
  EXPECT_EQ(c.get(9), 0u);
  c.signal(9, 3, &flag, 11);
  c.add({{9, 2}});
  EXPECT_EQ(flag, 0u);
  std::thread([&] { c.add({{9, 1}, {10, 1}}); }).join();
  EXPECT_EQ(std::atomic_ref<uint64_t>(flag).load(), 11u);
  EXPECT_EQ(c.get(9), 0u);
  EXPECT_EQ(c.get(10), 1u);
}

}  // namespace
