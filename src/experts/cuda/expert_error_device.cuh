// Device side of ExpertErrorRecord: the first thread to see a bad count
// claims the record, later ones leave it as it is.
#pragma once

#include "experts/expert_error.h"

namespace moelink::detail::experts {

__device__ inline void record_expert_error(ExpertErrorRecord* r, ExpertOp op, int expert,
                                           int64_t value, int64_t limit) {
  if (r == nullptr) return;
  if (atomicCAS(&r->code, static_cast<int32_t>(ExpertErrorCode::kOk),
                static_cast<int32_t>(ExpertErrorCode::kCountOutOfRange)) ==
      static_cast<int32_t>(ExpertErrorCode::kOk)) {
    r->op = static_cast<int32_t>(op);
    r->expert = expert;
    r->value = value;
    r->limit = limit;
  }
}

}  // namespace moelink::detail::experts
