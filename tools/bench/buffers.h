// The workload placed where the backend reads it (device or host memory):
// inputs, one copy of indices/weights/bound_m per routing set (so a timed
// iteration only switches pointers, never copies), and the outputs. The NCCL
// full path reuses the same inputs and expert tensors.
#pragma once

#include <vector>

#include "moelink/types.h"
#include "platform.h"
#include "workload.h"

namespace moelink_bench {

struct RoutingTensors {
  Mem indices_mem, weights_mem, bound_mem;
  moelink::Tensor indices, weights, bound_m;
};

struct Buffers {
  Mem x_mem, scale_mem, counts_mem, ex_mem, ex_scale_mem, y_mem, out_mem;
  moelink::Tensor dp_x, dp_x_scale;                 // [T, H], [T, S]
  std::vector<RoutingTensors> pool;                 // [T, k], [T, k], [1]
  moelink::Tensor out_expert_num_tokens;            // [L]
  moelink::Tensor out_expert_x, out_expert_x_scale; // [L, C, H], [L, C, S]
  moelink::Tensor expert_y;                         // [L, C, H] bf16
  moelink::Tensor out_tokens;                       // [T, H] out_dtype
};

Buffers make_buffers(Platform& pl, const Workload& w);

// The expert inputs as the identity experts read them.
IdentityExperts identity_of(const Buffers& b, const Workload& w, const int32_t* counts);

}  // namespace moelink_bench
