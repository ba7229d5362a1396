// The 1x128 group quantization kernels, as the host sees them: bf16 rows in,
// fp8 e4m3 rows and one fp32 scale per 128 elements out (fp8_group_quant.h).
// One kernel serves two calls, differing only in what a group's 128 input
// values are:
//   quantize:        x[r][g*128 + i]
//   silu_mul_quant:  silu(gu[r][g*128 + i]) * gu[r][I + g*128 + i]
// over `groups` groups of rows (experts; 1 for a dense tensor), each with
// its row count read on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "experts/expert_error.h"

namespace moelink::detail::experts {

struct GroupQuantArgs {
  const uint16_t* src;  // bf16
  int64_t src_group_stride, src_row_stride;  // elements; rows 16-byte aligned
  int64_t up_offset;    // silu_mul: elements from a row's gate half to its up half (I)
  uint8_t* q;           // fp8 e4m3
  int64_t q_group_stride, q_row_stride;  // elements; rows 8-byte aligned
  float* scale;
  int64_t scale_s0, scale_s1, scale_s2;  // [group, row, column group], any strides
  // Rows of group g: counts[g] clamped to [0, capacity] (reported when
  // clamped); every group has `capacity` rows when counts is null.
  const int32_t* counts;
  int64_t capacity;
  int32_t quant_groups_per_row;  // K / 128 (I / 128 for silu_mul)
  int32_t groups;
  ExpertOp op;
};

enum class GroupQuantInput { kPlain, kSiluMul };

// `programmatic`: launched with PDL (programmatic_launch.cuh).
void launch_group_quant(const GroupQuantArgs& args, GroupQuantInput input, int sm_count,
                        ExpertErrorRecord* error, cudaStream_t stream, bool programmatic);

}  // namespace moelink::detail::experts
