// Staging slots (layout.h) read and written by the host loops of kCPU and
// kInternodeCPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/all_to_all_impl.h"
#include "core/host_ops.h"
#include "core/layout.h"

namespace moelink::detail {

// The token and scales of a received slot into row `row` of local expert j
// of the batched-experts outputs.
inline void copy_slot_to_expert(const Geometry& G, const DispatchArgs& a, const char* slot,
                                int32_t j, int32_t row) {
  std::memcpy(elem(a.out_expert_x, j, row), slot + G.slot_token_offset, G.token_bytes);
  for (int s = 0; s < G.hidden_dim_scale; ++s)
    store<float>(elem(a.out_expert_x_scale, j, row, s),
                 load<float>(slot + G.slot_scale_offset + 4 * s));
}

}  // namespace moelink::detail
