// Host-side view of the NVSHMEM kernels: the parameter blocks they take and
// the functions that launch them. Plain C++, no NVSHMEM headers, so the
// host code needs neither nvcc nor NVSHMEM's device headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "nvshmem/layout.h"

namespace moelink::detail::shmem {

// Private per-rank device state that persists across calls and CUDA graph
// replays.
struct ShmemState {
  int32_t num_items;     // CombineItems the latest dispatch receive wrote
  int32_t dispatch_m;    // m of the latest dispatch send (tokens whose routes went out)
  uint64_t rounds_done;  // combine receives finished: the barrier's next target - 1
};

struct Common {
  Geometry geo;
  ShmemLayout lay;
  char* sym;  // this PE's symmetric buffer; the same address names it on every PE
  ShmemState* state;
  ErrorRecord* error;
  int32_t* positions;   // [E] next free chunk in (this rank, expert e)'s region on its rank
  CombineItem* items;   // [lay.stage_rows]
  uint64_t timeout_ns;
};

struct Matrix {  // a 2-D view, strides in elements
  const void* data;
  DType dtype;
  int64_t stride0, stride1;
};

struct DispatchParams {
  Common c;
  const char* x;  // [rows, H] in_dtype
  int64_t x_row_bytes;
  const float* x_scale;  // [rows, S]
  int64_t x_scale_s0, x_scale_s1;
  Matrix indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  int32_t* out_num_tokens;  // [L]
  char* out_x;              // [L, C, H]
  int64_t out_x_s0_bytes, out_x_s1_bytes;
  float* out_scale;  // [L, C, S]
  int64_t out_scale_s0, out_scale_s1, out_scale_s2;
};

struct CombineParams {
  Common c;
  const char* y;  // [L, C, H] of y_dtype
  DType y_dtype;
  int64_t y_s0_bytes, y_s1_bytes;
  char* out;  // [rows, H] out_dtype
  DType out_dtype;
  int64_t out_row_bytes;
  Matrix indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  bool accumulate;
};

// The send half, the receive half, or both in one cooperative kernel (all
// blocks resident, since receivers wait for what the senders of the same
// launch send). Launch errors throw SystemError.
void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s);
void launch_combine(const CombineParams& p, bool send, bool recv, int blocks, cudaStream_t s);

}  // namespace moelink::detail::shmem
