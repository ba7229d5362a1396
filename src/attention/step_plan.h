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

// Rows of x the step computes: q_start[B] when q_start starts at 0, never
// decreases and stays within the rows, and each of the first num_decode
// requests has at most 2 query tokens (the decode buffers hold 2 rows a
// request); else 0 (the whole step is skipped) with the first bad entry
// recorded.
MOELINK_HD int64_t step_rows(const int32_t* q_start, int num_requests, int num_decode, int64_t rows,
                             StepErrorRecord* e) {
  int32_t prev = 0;
  for (int j = 0; j <= num_requests; ++j) {
    const int32_t s = q_start[j];
    if (s < prev || s > rows || (j == 0 && s != 0)) {
      record_step_error(e, StepError::kQStart, j, 0, s, j == 0 ? 0 : rows);
      return 0;
    }
    if (j > 0 && j <= num_decode && s - prev > 2) {
      record_step_error(e, StepError::kDecodeLength, j - 1, 0, s - prev, 2);
      return 0;
    }
    prev = s;
  }
  return q_start[num_requests];
}

// Request i's length and pages (q_start already checked): false, with the
// failure recorded, when the request must be skipped.
MOELINK_HD bool request_ok(int i, const int32_t* q_start, const int32_t* kv_len,
                           const int32_t* block_row, const StepBounds& b, StepErrorRecord* e) {
  const int64_t q_len = static_cast<int64_t>(q_start[i + 1]) - q_start[i];
  const int64_t len = kv_len[i], capacity = static_cast<int64_t>(b.max_pages) * b.page_size;
  if (len < q_len || len > capacity) {
    record_step_error(e, StepError::kKvLength, i, 0, len, len < q_len ? q_len : capacity);
    return false;
  }
  const int64_t pages = (len + b.page_size - 1) / b.page_size;
  for (int64_t p = 0; p < pages; ++p)
    if (block_row[p] < 0 || block_row[p] >= b.num_pages) {
      record_step_error(e, StepError::kPageId, i, static_cast<int>(p), block_row[p], b.num_pages);
      return false;
    }
  return true;
}

}  // namespace moelink::detail::attention
