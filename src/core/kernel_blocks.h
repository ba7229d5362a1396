// How many thread blocks the NVLink and NVSHMEM kernels launch by default.
// Decode-sized buffers: enough warps to hide load latency, few enough to
// leave the GPU to compute beside the transfer. Prefill-sized buffers
// (>= kPrefillRows rows per expert): every SM, since the copies are then
// bandwidth-bound (bench/results: 4096 tokens ran 1.4x faster on 132 SMs
// than on 64). Options.num_blocks overrides.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/all_to_all_impl.h"

namespace moelink::detail {

constexpr int kDecodeBlocks = 64;
constexpr int64_t kPrefillRows = 2048;

inline bool prefill_sized(const Config& c) { return c.expert_capacity() >= kPrefillRows; }

inline int kernel_blocks(const ResolvedOptions& o, const Config& c, int num_sms) {
  if (o.num_blocks > 0) return std::min(o.num_blocks, num_sms);
  if (prefill_sized(c)) return num_sms;
  return std::min(num_sms, kDecodeBlocks);
}

}  // namespace moelink::detail
