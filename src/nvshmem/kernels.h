// Host-side view of the NVSHMEM kernels: the parameter blocks they take and
// the functions that launch them. Plain C++, no NVSHMEM headers, so the
// host code needs neither nvcc nor NVSHMEM's device headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/tensor_params.h"
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

// The call's tensors (core/tensor_params.h) and what every kernel needs.
struct DispatchParams : DispatchTensors {
  Common c;
};

struct CombineParams : CombineTensors {
  Common c;
};

// The send half, the receive half, or both in one cooperative kernel (all
// blocks resident, since receivers wait for what the senders of the same
// launch send). Launch errors throw SystemError.
void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s);
void launch_combine(const CombineParams& p, bool send, bool recv, int blocks, cudaStream_t s);

}  // namespace moelink::detail::shmem
