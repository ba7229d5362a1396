// Host conversions between fp32 and the 16-bit / 8-bit float formats, used
// by the CPU backend and the CPU expert kernels. Round to nearest even, like
// the CUDA intrinsics.
#pragma once

#include <cstdint>
#include <cstring>

#include "moelink/types.h"

namespace moelink::detail {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    float v = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;                      // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;                     // overflow -> inf
  if (a < 0x38800000u) {                                           // subnormal or zero
    float v = bits_f32(a) * 16777216.0f;                           // scale by 2^24
    uint32_t m = static_cast<uint32_t>(v);
    float rem = v - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t r = a - 0x38000000u;  // rebias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// fp8 e4m3 "fn" (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no
// infinities, 0x7f / 0xff NaN): round to nearest even, saturating at +-448
// like __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
inline uint8_t f32_to_e4m3(float f) {
  uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and inf): saturate
  if (a < 0x3c800000u) {                      // below 2^-6: subnormal steps of 2^-9
    const float v = bits_f32(a) * 512.0f;     // exact: a power-of-two scaling
    uint32_t m = static_cast<uint32_t>(v);
    const float rem = v - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;  // m == 8 is the smallest normal
    return sign | static_cast<uint8_t>(m);
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // round the mantissa to 3 bits
  r = (r >> 20) - ((127u - 7u) << 3);            // rebias the exponent 127 -> 7
  return sign | static_cast<uint8_t>(r > 0x7eu ? 0x7eu : r);
}
inline float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = (b & 0x80u) << 24, exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_f32(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {
    const float v = static_cast<float>(man) * (1.0f / 512.0f);  // man * 2^-9
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

// Loads element i of a row of bf16 / fp16 / fp32 values as fp32.
inline float load_as_f32(const void* row, DType t, int64_t i) {
  switch (t) {
    case DType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
    case DType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(row)[i]);
    default: return static_cast<const float*>(row)[i];
  }
}
// Stores v into element i of a bf16 / fp16 row.
inline void store_from_f32(void* row, DType t, int64_t i, float v) {
  auto* p = static_cast<uint16_t*>(row);
  p[i] = t == DType::kFloat16 ? f32_to_f16(v) : f32_to_bf16(v);
}

}  // namespace moelink::detail
