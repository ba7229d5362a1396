// prefill_calls (src/attention/prefill_calls.h) against causal visibility
// counted pair by pair: for every split of a request's query rows and every
// chunk of its keys, each (row, key) pair a row may see falls in exactly one
// call and no other pair in any.
#include <gtest/gtest.h>

#include "attention/prefill_calls.h"

namespace {

using moelink::detail::attention::PrefillCall;
using moelink::detail::attention::prefill_calls;

// How many of the calls let query row j (position q_pos0 + j) see key position p.
int covering(const std::array<PrefillCall, 3>& calls, int64_t j, int64_t p) {
  int n = 0;
  for (const PrefillCall& c : calls) {
    if (c.rows == 0) continue;
    EXPECT_GT(c.keys, 0);
    if (c.causal) {
      EXPECT_EQ(c.rows, c.keys) << "a causal call needs as many rows as keys";
    }
    const bool row_in = j >= c.row_first && j < c.row_first + c.rows;
    const bool key_in = p >= c.key_first && p < c.key_first + c.keys;
    if (row_in && key_in && (!c.causal || p - c.key_first <= j - c.row_first)) ++n;
  }
  return n;
}

TEST(PrefillCalls, EveryVisiblePairOnceAndNoOther) {
  int cases = 0;
  for (int64_t len = 1; len <= 23; ++len)
    for (int64_t q_rows = 1; q_rows <= len; ++q_rows)
      for (int64_t chunk : {1, 2, 3, 5, 8, 64}) {
        const int64_t q_pos0 = len - q_rows;
        for (int64_t k0 = 0; k0 < len; k0 += chunk) {
          const int64_t keys = std::min(chunk, len - k0);
          const auto calls = prefill_calls(q_pos0, q_rows, k0, keys);
          for (int64_t j = 0; j < q_rows; ++j)
            for (int64_t p = k0; p < k0 + keys; ++p)
              ASSERT_EQ(covering(calls, j, p), p <= q_pos0 + j ? 1 : 0)
                  << "len " << len << ", " << q_rows << " query rows, keys " << k0 << ".." << k0 + keys - 1
                  << ": row " << j << ", key " << p;
          ++cases;
        }
      }
  EXPECT_GT(cases, 1000);
}

TEST(PrefillCalls, ShapesOfTheThreeCalls) {
  // 1300 tokens, the last 300 queried, keys 1024..1299: the keys at the
  // query positions 1024.. causally, rows after them none (the chunk ends
  // with the request), keys before 1000 none (the chunk starts later).
  auto c = prefill_calls(1000, 300, 1024, 276);
  EXPECT_EQ(c[0].rows, 0);
  EXPECT_EQ(c[1].row_first, 24);
  EXPECT_EQ(c[1].rows, 276);
  EXPECT_TRUE(c[1].causal);
  EXPECT_EQ(c[2].rows, 0);
  // Keys 0..1023 for the same rows: 0..999 unmasked for all 300 rows,
  // 1000..1023 causally for rows 0..23, whole for rows 24..299.
  c = prefill_calls(1000, 300, 0, 1024);
  EXPECT_EQ(c[0].rows, 300);
  EXPECT_EQ(c[0].keys, 1000);
  EXPECT_FALSE(c[0].causal);
  EXPECT_EQ(c[1].row_first, 0);
  EXPECT_EQ(c[1].keys, 24);
  EXPECT_TRUE(c[1].causal);
  EXPECT_EQ(c[2].row_first, 24);
  EXPECT_EQ(c[2].rows, 276);
  EXPECT_EQ(c[2].key_first, 1000);
  EXPECT_FALSE(c[2].causal);
}

}  // namespace
