// The checks of one step's batch values (MLABatch), read where the step runs
// (the host loops here, the kernels later): each request's query rows,
// length and pages against the tensors' bounds. A request that fails is
// skipped (nothing read or written for it) and the first failure is kept
// in an error record for check(). Plain data and MOELINK_HD functions
// shared by the host and the device.
#pragma once

#include <cstdint>

#include "core/layout.h"  // MOELINK_HD

namespace moelink::detail::attention {

enum class StepError : int32_t {
  kOk = 0,
  kQStart = 1,      // q_start[request] = value: out of order, or past the rows of x (limit)
  kKvLength = 2,    // kv_len[request] = value: below the query tokens, or past the pages (limit)
  kPageId = 3,      // block_table[request][page] = value: outside [0, limit)
  kDecodeLength = 4,  // decode request `request` has value query tokens (limit 2)
};

struct StepErrorRecord {
  int32_t code;     // StepError; the first writer wins
  int32_t request;
  int32_t page;     // the block-table column (kPageId)
  int32_t reserved;
  int64_t value;
  int64_t limit;
};

// What the step may use: the rows of x, the cache's pages, the block
// table's columns, the page size.
struct StepBounds {
  int64_t rows;
  int64_t num_pages;
  int32_t max_pages;
  int32_t page_size;
};

MOELINK_HD void record_step_error(StepErrorRecord* e, StepError code, int request, int page,
                                  int64_t value, int64_t limit) {
  if (e->code == 0) *e = {static_cast<int32_t>(code), request, page, 0, value, limit};
}

// Entry j (0..num_requests) of q_start against its predecessor (0 before
// entry 0): kOk, or the error step_rows records, with its value and limit.
MOELINK_HD StepError q_start_entry(const int32_t* q_start, int j, int num_decode, int64_t rows,
                                   int64_t* value, int64_t* limit) {
  const int32_t s = q_start[j], prev = j > 0 ? q_start[j - 1] : 0;
  if (s < prev || s > rows || (j == 0 && s != 0)) {
    *value = s, *limit = j == 0 ? 0 : rows;
    return StepError::kQStart;
  }
  if (j > 0 && j <= num_decode && s - prev > 2) {
    *value = s - prev, *limit = 2;
    return StepError::kDecodeLength;
  }
  return StepError::kOk;
}

// The request q_start_entry(j) names: j - 1 for a decode length, else j.
MOELINK_HD int q_start_entry_request(StepError code, int j) { return code == StepError::kDecodeLength ? j - 1 : j; }

// Rows of x the step computes: q_start[B] when q_start starts at 0, never
// decreases and stays within the rows, and each of the first num_decode
// requests has at most 2 query tokens (the decode buffers hold 2 rows a
// request); else 0 (the whole step is skipped) with the first bad entry
// recorded.
MOELINK_HD int64_t step_rows(const int32_t* q_start, int num_requests, int num_decode, int64_t rows,
                             StepErrorRecord* e) {
  for (int j = 0; j <= num_requests; ++j) {
    int64_t value = 0, limit = 0;
    const StepError code = q_start_entry(q_start, j, num_decode, rows, &value, &limit);
    if (code != StepError::kOk) {
      record_step_error(e, code, q_start_entry_request(code, j), 0, value, limit);
      return 0;
    }
  }
  return q_start[num_requests];
}

// Request i's length against its query tokens and its pages' capacity
// (q_start already checked): false, with the failure recorded, when it
// must be skipped.
MOELINK_HD bool request_length_ok(int i, const int32_t* q_start, const int32_t* kv_len, const StepBounds& b,
                                  StepErrorRecord* e) {
  const int64_t q_len = static_cast<int64_t>(q_start[i + 1]) - q_start[i];
  const int64_t len = kv_len[i], capacity = static_cast<int64_t>(b.max_pages) * b.page_size;
  if (len < q_len || len > capacity) {
    record_step_error(e, StepError::kKvLength, i, 0, len, len < q_len ? q_len : capacity);
    return false;
  }
  return true;
}

// The pages a request of `len` tokens reads, and whether a page id is one
// of the cache's.
MOELINK_HD int64_t request_pages(int64_t len, const StepBounds& b) { return (len + b.page_size - 1) / b.page_size; }
MOELINK_HD bool page_id_ok(int32_t id, const StepBounds& b) { return id >= 0 && id < b.num_pages; }

// Request i's length and pages (q_start already checked): false, with the
// first failure recorded, when the request must be skipped.
MOELINK_HD bool request_ok(int i, const int32_t* q_start, const int32_t* kv_len,
                           const int32_t* block_row, const StepBounds& b, StepErrorRecord* e) {
  if (!request_length_ok(i, q_start, kv_len, b, e)) return false;
  const int64_t pages = request_pages(kv_len[i], b);
  for (int64_t p = 0; p < pages; ++p)
    if (!page_id_ok(block_row[p], b)) {
      record_step_error(e, StepError::kPageId, i, static_cast<int>(p), block_row[p], b.num_pages);
      return false;
    }
  return true;
}

}  // namespace moelink::detail::attention
