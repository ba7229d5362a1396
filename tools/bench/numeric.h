// Element conversions shared by host and device code of the bench: decoding
// the token types for the identity-expert check and rounding to bf16/fp16.
// Written out by hand so the host side needs no CUDA headers.
#pragma once

#include <cstdint>
#include <cstring>

#include "moelink/types.h"

#if defined(__CUDACC__)
#define BENCH_HD __host__ __device__ __forceinline__
#else
#define BENCH_HD inline
#endif

namespace moelink_bench {

BENCH_HD float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
BENCH_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// fp8 e4m3 "fn" (no infinities; 0x7f/0xff are NaN, which the inputs avoid).
BENCH_HD float fp8_e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xf, man = b & 7;
  float mag = exp == 0 ? man * (1.0f / 512.0f)  // subnormal: man/8 * 2^-6
                       : bits_to_float(static_cast<uint32_t>(exp - 7 + 127) << 23 |
                                       static_cast<uint32_t>(man) << 20);
  return (b & 0x80) ? -mag : mag;
}

BENCH_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even (inputs here are finite).
BENCH_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

BENCH_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  float mag;
  if (exp == 0)
    mag = man * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
  else if (exp == 31)
    mag = bits_to_float(0x7f800000u | man << 13);
  else
    mag = bits_to_float(static_cast<uint32_t>(exp - 15 + 127) << 23 | man << 13);
  return bits_to_float(float_to_bits(mag) | sign);
}

// Round to nearest even, saturating to infinity like the hardware.
BENCH_HD uint16_t float_to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  u &= 0x7fffffffu;
  if (u >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to inf
  if (u < 0x38800000u) {                       // below 2^-14: subnormal
    // Scale to units of 2^-24 and round to nearest even with float math.
    float s = bits_to_float(u) * 16777216.0f;
    float r = s - static_cast<float>(static_cast<int>(s));
    int i = static_cast<int>(s);
    if (r > 0.5f || (r == 0.5f && (i & 1))) ++i;
    return sign | static_cast<uint16_t>(i);
  }
  uint32_t v = u - (112u << 23);  // rebias exponent 127 -> 15
  v += 0xfff + ((v >> 13) & 1);
  return sign | static_cast<uint16_t>(v >> 13);
}

// One element of a token row of type `t` (fp8, bf16 or fp16) as float.
BENCH_HD float load_token_elem(const void* row, moelink::DType t, int64_t i) {
  if (t == moelink::DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
  if (t == moelink::DType::kFloat16) return fp16_to_float(static_cast<const uint16_t*>(row)[i]);
  return fp8_e4m3_to_float(static_cast<const uint8_t*>(row)[i]);
}

BENCH_HD uint16_t float_to_out(float f, bool bf16) {
  return bf16 ? float_to_bf16(f) : float_to_fp16(f);
}
BENCH_HD float out_to_float(uint16_t h, bool bf16) {
  return bf16 ? bf16_to_float(h) : fp16_to_float(h);
}

// The identity expert of the correctness check: y = x * scale, the scale of
// element i being scales[i * S / H] (block scaling), rounded to bf16.
BENCH_HD int64_t scale_index(int64_t i, int64_t H, int S) { return i * S / H; }

}  // namespace moelink_bench
