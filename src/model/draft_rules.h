// Speculative decoding's bookkeeping per request, one definition for the
// host loops (cpu_model_ops.cc) and the kernels (model_kernels.cu):
//
//   plan      request i samples its last num_drafts[i] + 1 rows: the row
//             before each draft token (does the model agree with the
//             draft?) and the last one (the token after the accepted ones);
//   accept    drafts are taken while the model's own sample before each
//             equals it, so the tokens a request gets are exactly the
//             model's samples, with or without drafts (sampling is keyed by
//             position, not by step);
//   MTP input the token after each row (what the MTP module embeds): the
//             next row's token id up to the first sampled row, the samples
//             from there.
#pragma once

#include <cstdint>

#include "core/layout.h"  // MOELINK_HD

namespace moelink::detail::model {

// Drafts a request may carry in one step (the MTP module proposes one).
inline constexpr int kMaxDrafts = 1;
inline constexpr int kSampleSlots = kMaxDrafts + 1;

struct SamplePlan {
  bool bad_drafts = false;  // num_drafts outside [0, min(slots - 1, q_len - 1)] (read as 0)
  int32_t drafts = 0;       // the drafts taken
};

// Slots j = i * slots + s of request i: row_index (-1: none, also for rows
// outside [0, rows): a bad q_start, which the attention reports) and position.
MOELINK_HD SamplePlan plan_request_samples(const int32_t* q_start, const int32_t* kv_len,
                                           const int32_t* num_drafts, int i, int slots, int32_t rows,
                                           int32_t* row_index, int32_t* position) {
  SamplePlan p;
  const int32_t q0 = q_start[i], q1 = q_start[i + 1];
  const int32_t nd = num_drafts ? num_drafts[i] : 0;
  const bool has_rows = q0 >= 0 && q1 > q0 && q1 <= rows;
  if (has_rows) {
    if (nd < 0 || nd > slots - 1 || nd > q1 - q0 - 1)
      p.bad_drafts = num_drafts != nullptr;
    else
      p.drafts = nd;
  }
  const int32_t first = q1 - 1 - p.drafts;
  for (int s = 0; s < slots; ++s) {
    const bool ok = has_rows && s <= p.drafts;
    row_index[i * slots + s] = ok ? first + s : -1;
    position[i * slots + s] = ok ? kv_len[i] - (q1 - (first + s)) : -1;
  }
  return p;
}

// How many of request i's drafts the model's samples confirm; its slots'
// sampled tokens are samples[0..slots) and its draft tokens the ids of the
// rows after the first sampled one.
MOELINK_HD int32_t accepted_drafts(const int32_t* samples, const int32_t* row_index, int slots,
                                   const int32_t* ids, int64_t ids_stride) {
  if (row_index[0] < 0) return 0;
  int32_t a = 0;
  while (a + 1 < slots && row_index[a + 1] >= 0 && samples[a] == ids[row_index[a + 1] * ids_stride]) ++a;
  return a;
}

// The token after row r of a request whose first sampled row is `first`
// (r within the request's rows); known_next >= 0 replaces the last row's
// sample (a prefill chunk that does not end its prompt). Never negative: a
// request whose sample failed embeds token 0 (its error is reported).
MOELINK_HD int32_t mtp_input_token(int64_t r, int32_t first, int32_t last, const int32_t* ids, int64_t ids_stride,
                                   const int32_t* samples, int32_t known_next) {
  int32_t t;
  if (r < first)
    t = ids[(r + 1) * ids_stride];
  else if (r == last && known_next >= 0)
    t = known_next;
  else
    t = samples[r - first];
  return t < 0 ? 0 : t;
}

}  // namespace moelink::detail::model
