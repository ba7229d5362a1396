// The tests' own element-type conversions: decode bf16 / fp16 / fp8-e4m3 /
// fp32 bit patterns to double, and round a double to bf16 / fp16 / fp32
// (round to nearest, ties to even). Written from the format definitions,
// independent of src/ (which they are meant to check).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "moelink/types.h"

namespace moelink_test {

// fp8 e4m3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
// S.1111.111 is NaN; max finite 448.
inline double fp8_e4m3_to_double(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, mant = b & 0x7;
  if (exp == 0xF && mant == 0x7) return std::numeric_limits<double>::quiet_NaN();
  double v = exp == 0 ? std::ldexp(mant / 8.0, -6) : std::ldexp(1.0 + mant / 8.0, exp - 7);
  return sign ? -v : v;
}

// bf16: the upper half of an fp32.
inline double bf16_to_double(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline double fp16_to_double(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  double v;
  if (exp == 0x1F)
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (exp == 0)
    v = std::ldexp(mant / 1024.0, -14);
  else
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  return sign ? -v : v;
}

inline double fp32_bits_to_double(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Decodes element i of a row of `dtype` elements (floating types only).
inline double decode_element(moelink::DType dtype, const void* row, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(row);
  switch (dtype) {
    case moelink::DType::kFloat8E4M3:
    case moelink::DType::kUInt8: return fp8_e4m3_to_double(p[i]);
    case moelink::DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_double(h);
    }
    case moelink::DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fp16_to_double(h);
    }
    case moelink::DType::kFloat32: {
      uint32_t u;
      std::memcpy(&u, p + 4 * i, 4);
      return fp32_bits_to_double(u);
    }
    default: throw std::logic_error("decode_element: not a floating dtype");
  }
}

// Rounds v to a binary format with `mant_bits` explicit mantissa bits and
// smallest normal exponent `emin` (subnormals below), ties to even. Values
// past the largest finite number become infinities (IEEE overflow rule).
inline double round_to_binary(double v, int mant_bits, int emin, double max_finite) {
  if (v == 0 || !std::isfinite(v)) return v;
  int e;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const int exp = std::max(e - 1, emin);
  const double quantum = std::ldexp(1.0, exp - mant_bits);
  const double r = std::nearbyint(v / quantum) * quantum;  // FE_TONEAREST: ties to even
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}

inline double round_to_bf16(double v) {
  return round_to_binary(v, 7, -126, std::ldexp(255.0 / 128.0, 127));
}
inline double round_to_fp16(double v) { return round_to_binary(v, 10, -14, 65504.0); }
inline double round_to_fp32(double v) { return static_cast<float>(v); }  // hardware RNE

inline double round_to_dtype(moelink::DType dtype, double v) {
  switch (dtype) {
    case moelink::DType::kBFloat16: return round_to_bf16(v);
    case moelink::DType::kFloat16: return round_to_fp16(v);
    case moelink::DType::kFloat32: return round_to_fp32(v);
    default: throw std::logic_error("round_to_dtype: not bf16/fp16/fp32");
  }
}

// Bit patterns of values that are exactly representable (already rounded).
inline uint16_t bf16_bits_exact(double v) {
  float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t fp16_bits_exact(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isnan(a)) return 0x7E00;
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  const int exp = e - 1;
  if (exp < -14) return sign | static_cast<uint16_t>(std::ldexp(a, 24));  // subnormal
  const auto mant = static_cast<uint16_t>(std::ldexp(a, 10 - exp) - 1024.0);
  return sign | static_cast<uint16_t>((exp + 15) << 10) | mant;
}

// fp8 e4m3 "fn" rounding with saturation (as __NV_SATFINITE): ties to even,
// finite values past +-448 become +-448.
inline double round_to_e4m3_sat(double v) {
  if (std::isnan(v)) return v;
  const double r = round_to_binary(std::fmax(-448.0, std::fmin(448.0, v)), 3, -6, 448.0);
  return std::fmax(-448.0, std::fmin(448.0, r));
}

// Bit pattern of an exactly representable e4m3 value (round_to_e4m3_sat's).
inline uint8_t fp8_e4m3_bits_exact(double v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(v);
  if (std::isnan(a)) return 0x7F;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  const int exp = e - 1;
  if (exp < -6) return sign | static_cast<uint8_t>(std::ldexp(a, 9));  // subnormal: a / 2^-9
  const auto mant = static_cast<uint8_t>(std::ldexp(a, 3 - exp) - 8.0);
  return sign | static_cast<uint8_t>((exp + 7) << 3) | mant;
}

// Rounds v to `dtype` and stores it as element i of a row.
inline void encode_element(moelink::DType dtype, double v, void* row, int64_t i) {
  auto* p = static_cast<uint8_t*>(row);
  switch (dtype) {
    case moelink::DType::kBFloat16: {
      uint16_t h = bf16_bits_exact(round_to_bf16(v));
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case moelink::DType::kFloat16: {
      uint16_t h = fp16_bits_exact(round_to_fp16(v));
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case moelink::DType::kFloat32: {
      float f = static_cast<float>(v);
      std::memcpy(p + 4 * i, &f, 4);
      return;
    }
    default: throw std::logic_error("encode_element: not bf16/fp16/fp32");
  }
}

// Unit roundoff (half an ulp at 1.0) of an output type.
inline double unit_roundoff(moelink::DType dtype) {
  switch (dtype) {
    case moelink::DType::kBFloat16: return std::ldexp(1.0, -8);
    case moelink::DType::kFloat16: return std::ldexp(1.0, -11);
    case moelink::DType::kFloat32: return std::ldexp(1.0, -24);
    default: throw std::logic_error("unit_roundoff: not bf16/fp16/fp32");
  }
}

}  // namespace moelink_test
