// A call's tensors as every GPU backend's kernels take them: raw pointers
// with byte or element strides, filled once from DispatchArgs / CombineArgs.
// Plain data (no nvcc needed): each backend's kernel parameter block derives
// from these and adds its own buffers, so the kernels read p.x, p.indices...
// whatever the backend.
#pragma once

#include <cstdint>

#include "core/all_to_all_impl.h"

namespace moelink::detail {

struct StridedMatrix {  // a 2-D view, strides in elements
  const void* data;
  DType dtype;
  int64_t stride0, stride1;
};

struct DispatchTensors {
  const char* x;  // [rows, H] in_dtype
  int64_t x_row_bytes;
  const float* x_scale;  // [rows, S]
  int64_t x_scale_s0, x_scale_s1;
  StridedMatrix indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  int32_t* out_num_tokens;  // [L]
  char* out_x;              // [L, C, H]
  int64_t out_x_s0_bytes, out_x_s1_bytes;
  float* out_scale;  // [L, C, S]
  int64_t out_scale_s0, out_scale_s1, out_scale_s2;
};

struct CombineTensors {
  const char* y;  // [L, C, H] of y_dtype
  DType y_dtype;
  int64_t y_s0_bytes, y_s1_bytes;
  char* out;  // [rows, H] out_dtype
  DType out_dtype;
  int64_t out_row_bytes;
  StridedMatrix indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  bool accumulate;
};

inline StridedMatrix strided_matrix(const Tensor& t) {
  return StridedMatrix{t.data, t.dtype, t.stride[0], t.stride[1]};
}
inline int64_t stride_bytes(const Tensor& t, int dim) {
  return t.stride[dim] * static_cast<int64_t>(dtype_size(t.dtype));
}

inline DispatchTensors dispatch_tensors(const DispatchArgs& a) {
  DispatchTensors t{};
  t.x = static_cast<const char*>(a.dp_x.data);
  t.x_row_bytes = stride_bytes(a.dp_x, 0);
  t.x_scale = static_cast<const float*>(a.dp_x_scale.data);
  t.x_scale_s0 = a.dp_x_scale.stride[0];
  t.x_scale_s1 = a.dp_x_scale.stride[1];
  t.indices = strided_matrix(a.indices);
  t.weights = strided_matrix(a.weights);
  t.bound_m = static_cast<const int32_t*>(a.bound_m.data);
  t.input_rows = a.input_rows;
  t.out_num_tokens = static_cast<int32_t*>(a.out_expert_num_tokens.data);
  t.out_x = static_cast<char*>(a.out_expert_x.data);
  t.out_x_s0_bytes = stride_bytes(a.out_expert_x, 0);
  t.out_x_s1_bytes = stride_bytes(a.out_expert_x, 1);
  t.out_scale = static_cast<float*>(a.out_expert_x_scale.data);
  t.out_scale_s0 = a.out_expert_x_scale.stride[0];
  t.out_scale_s1 = a.out_expert_x_scale.stride[1];
  t.out_scale_s2 = a.out_expert_x_scale.stride[2];
  return t;
}

inline CombineTensors combine_tensors(const CombineArgs& a) {
  CombineTensors t{};
  t.y = static_cast<const char*>(a.expert_y.data);
  t.y_dtype = a.expert_y.dtype;
  t.y_s0_bytes = stride_bytes(a.expert_y, 0);
  t.y_s1_bytes = stride_bytes(a.expert_y, 1);
  t.out = static_cast<char*>(a.out_tokens.data);
  t.out_dtype = a.out_tokens.dtype;
  t.out_row_bytes = stride_bytes(a.out_tokens, 0);
  t.indices = strided_matrix(a.indices);
  t.weights = strided_matrix(a.weights);
  t.bound_m = static_cast<const int32_t*>(a.bound_m.data);
  t.input_rows = a.input_rows;
  t.accumulate = a.accumulate;
  return t;
}

}  // namespace moelink::detail
