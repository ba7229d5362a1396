// How many blocks split each decode row's keys in moelink's MLA decode
// kernels (src/attention/cuda/mla_decode_tc.cu): host arithmetic alone, so
// the rule is tested on the CPU (tests/attention/test_decode_splits.cc).
//
// Blocks run in waves of `slots` (multiprocessors x blocks each). A split
// count s costs its waves times a block's stages, plus one stage for the
// block's prologue (its queries, its pipeline filled) and its share of the
// merge; the cheapest s in [1, most] wins, the fewest splits among equals.
// The host knows the decode rows only as a bound, twice the requests: with
// one query row a request half the grid's blocks leave at once. So the
// cost is summed over both cases, every request one row (busy_one) and
// every request two (busy_two). (Rounding up to fill the machine could
// start a second wave for a few blocks: 64 busy blocks on 132 slots took 3
// splits, 2 waves of 27 stages, where 2 splits run one wave of 40.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace moelink::detail::attention {

struct DecodeSplitShape {
  int64_t busy_one = 1;  // blocks with keys when every request has one query row
  int64_t busy_two = 1;  // ... when every request has two
  int64_t stages = 1;    // stages of keys of the longest row the block table allows
  int64_t slots = 1;     // blocks that run at once
  int64_t most = 1;      // the largest split count allowed
};

inline int64_t decode_split_cost(const DecodeSplitShape& s, int64_t splits) {
  const int64_t per_block = (s.stages + splits - 1) / splits + 1;
  int64_t cost = 0;
  for (const int64_t busy : {s.busy_one, s.busy_two}) cost += (busy * splits + s.slots - 1) / s.slots * per_block;
  return cost;
}

inline int64_t decode_splits(const DecodeSplitShape& s) {
  int64_t best = 1, best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t splits = 1; splits <= std::max<int64_t>(1, s.most); ++splits) {
    const int64_t cost = decode_split_cost(s, splits);
    if (cost < best_cost) best = splits, best_cost = cost;
  }
  return best;
}

}  // namespace moelink::detail::attention
