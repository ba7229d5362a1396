// decode_splits (src/attention/decode_splits.h): worked cases of moelink's
// decode grid on 132 multiprocessors, and on random shapes the choice
// against every other split count's cost counted here wave by wave.
#include <gtest/gtest.h>

#include <random>

#include "attention/decode_splits.h"

namespace {

using moelink::detail::attention::decode_splits;
using moelink::detail::attention::DecodeSplitShape;

// The warpgroup kernel at 128 heads (2 head blocks a row), kv 5000 (79
// stages, at least 4 a split: 19 at most), one block a multiprocessor.
DecodeSplitShape wgmma_shape(int64_t requests) {
  DecodeSplitShape s;
  s.busy_one = 2 * requests;
  s.busy_two = 4 * requests;
  s.stages = 79;
  s.slots = 132;
  s.most = 19;
  return s;
}

TEST(DecodeSplits, WorkedCasesOn132Multiprocessors) {
  // One request: 16 splits of 5 stages (19 of 4 or 5 take as long: the
  // fewest of those).
  EXPECT_EQ(decode_splits(wgmma_shape(1)), 16);
  // 32 requests: 2 splits (64 or 128 busy blocks: one wave of 41 stages or
  // two), where filling the machine by rounding up took 3 (2 or 3 waves of 28).
  EXPECT_EQ(decode_splits(wgmma_shape(32)), 2);
  // 8 requests: 8 splits (128 blocks, one wave of 11 stages, or two).
  EXPECT_EQ(decode_splits(wgmma_shape(8)), 8);
  // 128 requests: the grid is two waves or more already.
  EXPECT_EQ(decode_splits(wgmma_shape(128)), 1);
  // No split allowed (a short block table): 1.
  DecodeSplitShape s = wgmma_shape(1);
  s.most = 0;
  EXPECT_EQ(decode_splits(s), 1);
}

// Blocks of equal work on `slots` at once: waves, each as long as a block.
int64_t time_by_waves(int64_t busy, int64_t splits, int64_t stages, int64_t slots) {
  int64_t time = 0;
  for (int64_t left = busy * splits; left > 0; left -= slots) time += (stages + splits - 1) / splits + 1;
  return time;
}

TEST(DecodeSplits, RandomShapesTakeTheCheapestAndTheFewestAmongEquals) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 2000; ++trial) {
    DecodeSplitShape s;
    s.busy_one = 1 + static_cast<int64_t>(rng() % 300);
    s.busy_two = s.busy_one * (1 + static_cast<int64_t>(rng() % 2));
    s.stages = 1 + static_cast<int64_t>(rng() % 600);
    s.slots = 1 + static_cast<int64_t>(rng() % 300);
    s.most = 1 + static_cast<int64_t>(rng() % 64);
    auto cost = [&](int64_t n) {
      return time_by_waves(s.busy_one, n, s.stages, s.slots) + time_by_waves(s.busy_two, n, s.stages, s.slots);
    };
    const int64_t got = decode_splits(s);
    ASSERT_GE(got, 1);
    ASSERT_LE(got, s.most);
    for (int64_t n = 1; n <= s.most; ++n) {
      if (n < got) {
        ASSERT_GT(cost(n), cost(got)) << "fewer splits cost no more: " << n << " against " << got;
      } else {
        ASSERT_GE(cost(n), cost(got)) << n << " splits are cheaper than " << got;
      }
    }
  }
}

}  // namespace
