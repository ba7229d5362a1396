// Host-side view of the inter-node GPU kernels (gpu_kernels.cu): what they
// take and the functions that launch them. Plain C++, no nvcc needed.
//
// The kernels only pack and unpack; the proxy thread moves the bytes. Send
// and receive buffers and the proxy's plan live in pinned host memory mapped
// into the GPU (host staging: the path for providers without GPUDirect RDMA),
// so the kernels read and write them over PCIe and the engine registers
// plain host memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layout.h"
#include "internode/protocol.h"

namespace moelink::detail::internode {

struct Matrix2D {  // a 2-D view, strides in elements
  const void* data;
  DType dtype;
  int64_t stride0, stride1;
};

// Device memory that persists across calls.
struct GpuState {
  int32_t* dest_index;      // [T][W] position j of token t among its sender's tokens for rank r, -1
  uint32_t* counts;         // [dp][W] tokens replica q sends rank r
  int32_t* expert_counter;  // [L] rows taken per local expert
  int32_t* recv_routes_n;   // [G*T] routes of each received slot (0 when dropped)
  RouteEntry* recv_routes;  // [G*T][k]
  int32_t* recv_rows;       // [G*T][k] row in out_expert_x, -1 dropped
  int32_t* dispatch_m;      // [1] m of the last dispatch send
  ErrorRecord* error;       // first input error
};

struct GpuCommon {
  Geometry geo;
  Layout layout;
  PlanView plan_view;
  uint32_t epoch;
  char* send;            // device view of the pinned send buffer
  char* recv;            // device view of the pinned recv buffer
  const int64_t* plan;   // device view of the proxy's plan
  GpuState state;
};

struct GpuDispatchParams {
  GpuCommon c;
  const char* x;
  int64_t x_row_bytes;
  const float* x_scale;
  int64_t x_scale_s0, x_scale_s1;
  Matrix2D indices, weights;
  const int32_t* bound_m;
  int64_t input_rows;
  int32_t* out_num_tokens;
  char* out_x;
  int64_t out_x_s0_bytes, out_x_s1_bytes;
  float* out_scale;
  int64_t out_scale_s0, out_scale_s1, out_scale_s2;
};

struct GpuCombineParams {
  GpuCommon c;
  const char* y;
  DType y_dtype;
  int64_t y_s0_bytes, y_s1_bytes;
  char* out;
  DType out_dtype;
  int64_t out_row_bytes;
  const int32_t* bound_m;
  int64_t input_rows;
  bool accumulate;
};

// dispatch send: route positions and counts, then the packed blocks and the
// header in the send buffer. dispatch recv: the received slots to the
// batched-experts layout, then the counts. combine send: one weighted row
// per received slot into the send buffer. combine recv: the rows summed into
// out_tokens. Each returns the launch error.
cudaError_t launch_dispatch_pack(const GpuDispatchParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_unpack(const GpuDispatchParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_pack(const GpuCombineParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_unpack(const GpuCombineParams& p, int blocks, cudaStream_t stream);

}  // namespace moelink::detail::internode
