// Host-side view of the NVLink kernels: the parameter blocks they take and
// the functions that launch them. Plain C++ so the host code needs no nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layout.h"

namespace moelink::detail {

// Per-rank device state that persists across calls (and CUDA graph replays).
// There is no epoch counter here: a rank's epoch is derived from its own
// dispatch flag (see current_epoch in device_utils.cuh).
struct DeviceState {
  int32_t num_valid;            // staging slots dispatch recv accepted (for combine send)
  uint32_t counts_reset_epoch;  // fused prefill dispatch: counts reset for this epoch
};

constexpr int kMaxNvlinkWorldSize = 128;

// What every kernel needs to find buffers and report errors.
struct CommonParams {
  Geometry geo;
  // Peer-mapped buffer base of every rank (own included). Passed by value so
  // that finding a peer costs a constant-cache read, not a dependent load.
  char* peers[kMaxNvlinkWorldSize];
  char* local;         // this rank's buffer
  DeviceState* state;
  int32_t* route_rows;   // [G][T][k] row of each accepted route entry, -1 if dropped
  int32_t* valid_slots;  // [G*T] slot ids g*T+t accepted in this dispatch
  ErrorRecord* error;    // device memory
  uint64_t timeout_ns;
};

struct StridedMatrix {  // a 2-D view, strides in elements
  const void* data;
  DType dtype;
  int64_t stride0, stride1;
};

struct DispatchParams {
  CommonParams c;
  // inputs
  const char* x;  // [rows, H] in_dtype, row stride in bytes below
  int64_t x_row_bytes;
  const float* x_scale;  // [rows, S]
  int64_t x_scale_s0, x_scale_s1;
  StridedMatrix indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  // Fused launches only: blocks that receive while the others send (0: all
  // blocks send, then all receive).
  int recv_blocks;
  // outputs
  int32_t* out_num_tokens;  // [L]
  char* out_x;              // [L, C, H]
  int64_t out_x_s0_bytes, out_x_s1_bytes;
  float* out_scale;  // [L, C, S]
  int64_t out_scale_s0, out_scale_s1, out_scale_s2;
};

struct CombineParams {
  CommonParams c;
  const char* y;  // [L, C, H] of y_dtype
  DType y_dtype;
  int64_t y_s0_bytes, y_s1_bytes;
  char* out;  // [rows, H] out_dtype
  DType out_dtype;
  int64_t out_row_bytes;
  StridedMatrix indices;
  const int32_t* bound_m;
  int64_t input_rows;
  bool accumulate;
};

// Launch the send half, the receive half, or both fused into one kernel
// (one launch fewer; a cooperative launch, so that all blocks are resident
// while some wait for the flags that the others' send half raises).
void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s);
void launch_combine(const CombineParams& p, bool send, bool recv, int blocks, cudaStream_t s);

constexpr int kThreadsPerBlock = 512;

}  // namespace moelink::detail
