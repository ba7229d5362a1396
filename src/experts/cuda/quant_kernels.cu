// The 1x128 group quantization kernel (quant_kernels.h). Sixteen lanes hold
// one group, eight consecutive elements each (one 16-byte load of bf16, two
// for silu_mul's gate and up); a warp handles two groups at a time. The
// group's amax is a 4-step butterfly over its 16 lanes, the scale and the
// 8 fp8 bytes per lane follow (values times the scale's reciprocal), and
// lane 0 of the 16 writes the scale.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "experts/cuda/expert_error_device.cuh"
#include "experts/cuda/programmatic_launch.cuh"
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

// Eight values times the scale's reciprocal, as 8 e4m3 bytes.
__device__ inline uint2 to_e4m3x8(const float v[8], float inv_scale) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(v[2 * i] * inv_scale, v[2 * i + 1] * inv_scale);
    const uint16_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
    w[i] = two;
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// silu(gate) * up with the SFU's exp and an approximate division (a few
// ulp from expf and an IEEE division: far below the fp8 step that follows;
// the kernel is bound by instructions, not bytes, with the exact ones).
__device__ inline float fast_silu_mul(float gate, float up) {
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
}

// A group's 8 values of this lane (zeros when the group is past the row's
// end): x, or silu(gate) * up.
template <GroupQuantInput kInput>
__device__ inline void load_group_values(const uint16_t* row, int64_t up_offset, int col,
                                         bool valid, float v[8]) {
  if (!valid) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    return;
  }
  load_bf16x8(row + col, v);
  if constexpr (kInput == GroupQuantInput::kSiluMul) {
    float up[8];
    load_bf16x8(row + up_offset + col, up);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = fast_silu_mul(v[i], up[i]);
  }
}

// Blocks take rows (block b: rows b, b + gridDim.x, ...) of group
// blockIdx.y; a block's warps take the row's column groups two at a time.
// No division in the loops: the row and its columns are loop counters.
// (Two rows per block in flight measured slower for quantize on the H200:
// 126 against 95 us for 16384 x 7168; bench/results/README.md.)
template <GroupQuantInput kInput>
__global__ void __launch_bounds__(kThreads)
    group_quant_kernel(GroupQuantArgs a, ExpertErrorRecord* error) {
  begin_programmatic_kernel();
  const int g = blockIdx.y;
  const int32_t seen = a.counts ? a.counts[g] : static_cast<int32_t>(a.capacity);
  bool bad = false;
  const int64_t rows = clamp_m(seen, a.capacity, &bad);
  if (bad && blockIdx.x == 0 && threadIdx.x == 0) record_expert_error(error, a.op, g, seen, a.capacity);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int half = lane / kLanesPerGroup, lane16 = lane % kLanesPerGroup;
  const int col_groups = a.quant_groups_per_row;
  const uint16_t* src_group = a.src + g * a.src_group_stride;
  uint8_t* q_group = a.q + g * a.q_group_stride;
  float* scale_group = a.scale + g * a.scale_s0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    // The loop bound is the same for the whole warp, so every lane reaches
    // the shuffles; a half past the row's end computes on zeros and stores
    // nothing.
    for (int pair = warp * 2; pair < col_groups; pair += kThreads / 32 * 2) {
      const int col_group = pair + half;
      const bool valid = col_group < col_groups;
      const int col = col_group * kQuantGroup + lane16 * kValuesPerLane;
      float v[8];
      load_group_values<kInput>(src_group + row * a.src_row_stride, a.up_offset, col, valid, v);
      const float scale = group_scale(group_amax(v));
      if (valid) {
        *reinterpret_cast<uint2*>(q_group + row * a.q_row_stride + col) = to_e4m3x8(v, 1.0f / scale);
        if (lane16 == 0) scale_group[row * a.scale_s1 + col_group * a.scale_s2] = scale;
      }
    }
  }
}

}  // namespace

void launch_group_quant(const GroupQuantArgs& args, GroupQuantInput input, int sm_count,
                        ExpertErrorRecord* error, cudaStream_t stream, bool programmatic) {
  if (args.groups <= 0) return;
  // A block per row of a full group, capped so that all groups together
  // keep about 8 blocks per SM; blocks loop over the rows left. Groups with
  // fewer rows leave blocks idle at once.
  const int64_t cap = std::max<int64_t>(1, int64_t{sm_count} * 8 / args.groups);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(args.capacity, 1), cap)),
                  static_cast<unsigned>(args.groups));
  launch_expert_kernel(input == GroupQuantInput::kSiluMul ? group_quant_kernel<GroupQuantInput::kSiluMul>
                                                         : group_quant_kernel<GroupQuantInput::kPlain>,
                       grid, dim3(kThreads), 0, stream, programmatic, args, error);
}

}  // namespace moelink::detail::experts
