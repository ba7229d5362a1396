// The 1x128 group quantization kernel (quant_kernels.h). Sixteen lanes hold
// one group, eight consecutive elements each (one 16-byte load of bf16, two
// for silu_mul's gate and up); a warp handles two groups at a time. The
// group's amax is a 4-step butterfly over its 16 lanes, the scale and the
// 8 fp8 bytes per lane follow, and lane 0 of the 16 writes the scale.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "experts/cuda/expert_error_device.cuh"
#include "experts/cuda/quant_kernels.h"
#include "experts/fp8_group_quant.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::experts {
namespace {

constexpr int kThreads = 256;
constexpr int kLanesPerGroup = 16;
constexpr int kValuesPerLane = kQuantGroup / kLanesPerGroup;  // 8
static_assert(kValuesPerLane == 8, "one 16-byte load of bf16 per lane");

// Eight bf16 values (16 bytes) widened to fp32.
__device__ inline void load_bf16x8(const uint16_t* p, float v[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// The largest |v| of a group: each lane's own, then a butterfly over the 16
// lanes of its half-warp (xor offsets < 16 stay in the half). Every lane of
// the warp must call it.
__device__ inline float group_amax(const float v[8]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));
#pragma unroll
  for (int offset = kLanesPerGroup / 2; offset > 0; offset >>= 1)
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
  return a;
}

// Eight values divided by the scale, as 8 e4m3 bytes.
__device__ inline uint2 to_e4m3x8(const float v[8], float scale) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(v[2 * i] / scale, v[2 * i + 1] / scale);
    const uint16_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
    w[i] = two;
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

template <GroupQuantInput kInput>
__global__ void __launch_bounds__(kThreads)
    group_quant_kernel(GroupQuantArgs a, ExpertErrorRecord* error) {
  const int g = blockIdx.y;
  const int64_t seen = a.counts ? a.counts[g] : a.capacity;
  bool bad = false;
  const int64_t rows = clamp_rows(seen, a.capacity, &bad);
  if (bad && blockIdx.x == 0 && threadIdx.x == 0) record_expert_error(error, a.op, g, seen, a.capacity);

  const int lane = threadIdx.x % 32;
  const int half = lane / kLanesPerGroup, lane16 = lane % kLanesPerGroup;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kThreads / 32;
  const int64_t jobs = rows * a.quant_groups_per_row;  // (row, column group) pairs
  // The loop bound is the same for the whole warp, so every lane reaches the
  // shuffles; a half whose job is past the end computes on zeros and stores
  // nothing.
  for (int64_t pair = warp * 2; pair < jobs; pair += num_warps * 2) {
    const int64_t job = pair + half;
    const bool valid = job < jobs;
    const int64_t row = valid ? job / a.quant_groups_per_row : 0;
    const int64_t col_group = valid ? job % a.quant_groups_per_row : 0;
    const int64_t col = col_group * kQuantGroup + lane16 * kValuesPerLane;
    float v[8];
    if (valid) {
      const uint16_t* src = a.src + g * a.src_group_stride + row * a.src_row_stride + col;
      load_bf16x8(src, v);
      if constexpr (kInput == GroupQuantInput::kSiluMul) {
        float up[8];
        load_bf16x8(src + a.up_offset, up);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = silu_mul(v[i], up[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
    const float scale = group_scale(group_amax(v));
    if (valid) {
      *reinterpret_cast<uint2*>(a.q + g * a.q_group_stride + row * a.q_row_stride + col) =
          to_e4m3x8(v, scale);
      if (lane16 == 0) a.scale[g * a.scale_s0 + row * a.scale_s1 + col_group * a.scale_s2] = scale;
    }
  }
}

}  // namespace

void launch_group_quant(const GroupQuantArgs& args, GroupQuantInput input, int sm_count,
                        ExpertErrorRecord* error, cudaStream_t stream) {
  if (args.groups <= 0) return;
  // Enough warps for every (row, column group) pair of a full group, capped
  // so that all groups together keep about 8 blocks per SM; blocks loop
  // over what is left. Groups with fewer rows leave blocks idle at once.
  const int64_t warps_per_group = (args.capacity * args.quant_groups_per_row + 1) / 2;
  const int64_t blocks_needed = std::max<int64_t>(1, (warps_per_group + kThreads / 32 - 1) / (kThreads / 32));
  const int64_t cap = std::max<int64_t>(1, int64_t{sm_count} * 8 / args.groups);
  const dim3 grid(static_cast<unsigned>(std::min(blocks_needed, cap)), static_cast<unsigned>(args.groups));
  if (input == GroupQuantInput::kSiluMul)
    group_quant_kernel<GroupQuantInput::kSiluMul><<<grid, kThreads, 0, stream>>>(args, error);
  else
    group_quant_kernel<GroupQuantInput::kPlain><<<grid, kThreads, 0, stream>>>(args, error);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::experts
