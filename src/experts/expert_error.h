// What the expert kernels report about their input while they run: a row
// count outside [0, C] (clamped with core/layout.h's clamp_m, never used to
// index past C), recorded by the first kernel that sees it and read by
// Experts::check(). Plain data shared by the CUDA kernels, the CPU
// implementation and the host.
#pragma once

#include <cstdint>


namespace moelink::detail::experts {

enum class ExpertErrorCode : int32_t {
  kOk = 0,
  kCountOutOfRange = 1,  // expert_num_tokens[expert] (or bound_m) = value, allowed [0, limit]
};

// Which call saw it (named in the error message).
enum class ExpertOp : int32_t {
  kGroupedGemm = 0,
  kSiluMulQuant = 1,
  kQuantize = 2,
  kGemm = 3,
  kForward = 4,
};

struct ExpertErrorRecord {
  int32_t code;  // ExpertErrorCode; the first writer wins
  int32_t op;    // ExpertOp
  int32_t expert;  // group index (0 for the dense calls)
  int32_t reserved;
  int64_t value;  // the count seen
  int64_t limit;  // the rows the tensor has (C, or M for the dense calls)
};

}  // namespace moelink::detail::experts
