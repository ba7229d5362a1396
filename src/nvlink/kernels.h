// Host-side view of the NVLink kernels: the parameter blocks they take and
// the functions that launch them. Plain C++ so the host code needs no nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layout.h"
#include "core/tensor_params.h"

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

// The call's tensors (core/tensor_params.h) and what every kernel needs.
struct DispatchParams : DispatchTensors {
  CommonParams c;
  // Fused launches only: blocks that receive while the others send (0: all
  // blocks send, then all receive).
  int recv_blocks;
};

struct CombineParams : CombineTensors {
  CommonParams c;
};

// Launch the send half, the receive half, or both fused into one kernel
// (one launch fewer; a cooperative launch, so that all blocks are resident
// while some wait for the flags that the others' send half raises).
void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s);
void launch_combine(const CombineParams& p, bool send, bool recv, int blocks, cudaStream_t s);

constexpr int kThreadsPerBlock = 512;

}  // namespace moelink::detail
