// How one chunk of a prefill request's keys splits into calls of a kernel
// whose causal mask aligns a call's last query row with its last key
// (FlashInfer's prefill): the chunk's keys before the first query position,
// seen whole by every row; its keys at the query positions, causally by the
// rows at those same positions (as many rows as keys); and those keys again,
// whole, by the rows after the chunk. Every (row, key) pair with key
// position <= row position falls in exactly one call, every other pair in
// none (tests/attention/test_prefill_calls.cc).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace moelink::detail::attention {

struct PrefillCall {
  int64_t row_first = 0, rows = 0;  // query rows (0: the request's first query row)
  int64_t key_first = 0, keys = 0;  // key positions
  bool causal = false;              // row row_first + i sees keys key_first .. key_first + i
};

// The query rows sit at positions q_pos0 .. q_pos0 + q_rows - 1, the chunk's
// keys at k_pos0 .. k_pos0 + keys - 1 (k_pos0 + keys <= q_pos0 + q_rows).
// Calls without rows or keys come back empty (rows = keys = 0).
inline std::array<PrefillCall, 3> prefill_calls(int64_t q_pos0, int64_t q_rows, int64_t k_pos0, int64_t keys) {
  std::array<PrefillCall, 3> calls{};
  const int64_t k_end = k_pos0 + keys;
  auto set = [](PrefillCall& c, int64_t row_first, int64_t rows, int64_t key_first, int64_t n, bool causal) {
    if (rows > 0 && n > 0) c = {row_first, rows, key_first, n, causal};
  };
  set(calls[0], 0, q_rows, k_pos0, std::min(k_end, q_pos0) - k_pos0, false);
  const int64_t a = std::max(k_pos0, q_pos0);
  if (a < k_end) {
    set(calls[1], a - q_pos0, k_end - a, a, k_end - a, true);
    set(calls[2], k_end - q_pos0, q_pos0 + q_rows - k_end, a, k_end - a, false);
  }
  return calls;
}

}  // namespace moelink::detail::attention
