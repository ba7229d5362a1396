// Token choice from one row of logits (StepInput's SamplingParams), one
// definition for the host loops and the kernels: greedy at temperature 0
// (the first largest logit), else softmax(logits / temperature) over the
// top_k largest (0: all), cut to the smallest set whose mass reaches top_p,
// drawn with a counter-based uniform keyed by (seed, position).
#pragma once

#include <cstdint>

#include "core/layout.h"  // MOELINK_HD

namespace moelink::detail::model {

// splitmix64's finalizer: a well-mixed 64-bit value of its input.
MOELINK_HD uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform double in [0, 1) for (seed, position): the same on every rank,
// batch and device.
MOELINK_HD double sample_uniform(int64_t seed, int64_t position) {
  const uint64_t z = mix64(mix64(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(position));
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

}  // namespace moelink::detail::model
