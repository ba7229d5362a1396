// The quantization every expert kernel applies to activations, shared by the
// CUDA kernels and the CPU implementation: fp8 e4m3 with one fp32 scale per
// 128 consecutive elements of a row (DeepSeek-V3's 1x128 activation groups),
//   scale = max(amax, 1e-10) / 448,   q = e4m3_satfinite(x * (1 / scale)),
// the rule of vLLM's and SGLang's per_token_group_quant_fp8 (which divide by
// the scale: at most an fp32 ulp apart before the fp8 rounding; the floor on
// amax keeps a group of zeros finite). And SiLU-and-mul on the gate and up
// halves of the first GEMM's output.
#pragma once

#include <cmath>

#include "core/layout.h"  // MOELINK_HD

namespace moelink::detail::experts {

constexpr int kQuantGroup = 128;        // elements per scale (activations: 1 x 128)
constexpr int kWeightBlock = 128;       // weight scales: one per 128 x 128 block
constexpr float kFp8E4M3Max = 448.0f;   // largest finite e4m3 "fn" value
constexpr float kMinGroupAmax = 1e-10f;

MOELINK_HD float group_scale(float amax) { return fmaxf(amax, kMinGroupAmax) / kFp8E4M3Max; }

// silu(gate) * up in fp32 (the CUDA kernel computes the same with the SFU's
// exp and reciprocal: a few fp32 ulp apart).
MOELINK_HD float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

}  // namespace moelink::detail::experts
