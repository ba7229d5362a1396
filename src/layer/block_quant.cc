#include "layer/block_quant.h"

#include <algorithm>
#include <cmath>

#include "core/float_convert.h"

namespace moelink::detail::layer {

void quantize_weight_blocks(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  constexpr int64_t B = 128;
  for (int64_t br = 0; br < rows / B; ++br)
    for (int64_t bc = 0; bc < cols / B; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * B; r < (br + 1) * B; ++r)
        for (int64_t c = bc * B; c < (bc + 1) * B; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float s = std::max(amax, 1e-12f) / 448.0f;
      scale[br * (cols / B) + bc] = s;
      for (int64_t r = br * B; r < (br + 1) * B; ++r)
        for (int64_t c = bc * B; c < (bc + 1) * B; ++c) q[r * cols + c] = f32_to_e4m3(w[r * cols + c] / s);
    }
}

}  // namespace moelink::detail::layer
