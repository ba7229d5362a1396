// bf16 values kept as their 16 bits (uint16_t, as moelink's tensors pass
// them) to and from fp32 in device code: round to nearest even.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace moelink::detail {

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}

}  // namespace moelink::detail
