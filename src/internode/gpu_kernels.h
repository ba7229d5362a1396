// Host-side view of the inter-node GPU kernels (gpu_kernels.cu): what they
// take and the functions that launch them. Plain C++, no nvcc needed.
//
// The kernels pack and unpack; the proxy thread moves the bytes to other
// nodes. Send and receive buffers live in pinned host memory mapped into
// the GPU (host staging: the path for providers without GPUDirect RDMA, the
// kernels read and write them over PCIe) or, with Options.gpu_direct, in
// device memory the NIC reads and writes. Node peers' slots and rows the
// kernels store themselves, over NVLink, into the peers' local areas
// (device memory mapped through CUDA IPC; protocol.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layout.h"
#include "core/tensor_params.h"
#include "internode/protocol.h"

namespace moelink::detail::internode {

// Device memory that persists across calls.
struct GpuState {
  int32_t* dest_index;      // [T][W] position j of token t among its sender's tokens for rank r, -1
  uint32_t* counts;         // [dp][W] tokens replica q sends rank r
  int32_t* expert_counter;  // [L] rows taken per local expert
  int32_t* recv_routes_n;   // [G*T] routes of each received slot (0 when dropped)
  RouteEntry* recv_routes;  // [G*T][k]
  int32_t* recv_rows;       // [G*T][k] row in out_expert_x, -1 dropped
  int32_t* recv_sender;     // [G*T] the rank each received slot came from
  int32_t* dispatch_m;      // [1] m of the last dispatch send
  uint32_t* epoch;          // [1] dispatch sends so far: graph replays advance it too
  ErrorRecord* error;       // first input error
};

struct GpuCommon {
  Geometry geo;
  Layout layout;
  PlanView plan_view;
  char* send;           // the send buffer (device view of pinned memory, or device memory)
  char* recv;           // the recv buffer (likewise)
  char* own_header;     // device view of a pinned copy of this rank's RouteHeader + counts
  const int64_t* plan;  // the proxy's plan (pinned memory or, with GDRCopy, device memory)
  char* local;          // this rank's local area (device memory)
  char* const* local_bases;  // [node_size] device array: node peers' local areas, mapped here
  GpuState state;
  uint64_t* request;  // device view of ProxySignals::request
};

// The call's tensors (core/tensor_params.h) and what every kernel needs.
struct GpuDispatchParams : DispatchTensors {
  GpuCommon c;
};

struct GpuCombineParams : CombineTensors {
  GpuCommon c;
};

// dispatch send: the next epoch, route positions and counts, the packed
// blocks and the header in the send buffer, then the proxy's request.
// dispatch recv: the received slots to the batched-experts layout, then the
// counts. combine send: one weighted row per received slot into the send
// buffer, then the request. combine recv: the rows summed into out_tokens.
// Each returns the launch error.
cudaError_t launch_dispatch_pack(const GpuDispatchParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_unpack(const GpuDispatchParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_pack(const GpuCombineParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_unpack(const GpuCombineParams& p, int blocks, cudaStream_t stream);

}  // namespace moelink::detail::internode
