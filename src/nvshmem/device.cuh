// Device-side pieces the NVSHMEM kernels share: the NVSHMEM device API, the
// wait with a deadline, addressing the symmetric buffer, and the generic
// helpers of the NVLink kernels (error record, timer, 8-element conversions,
// launch helper).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvlink/device_utils.cuh"
#include "nvshmem/kernels.h"

namespace moelink::detail::shmem {

constexpr int kWarps = kThreadsPerBlock / 32;

template <typename T = char>
__device__ __forceinline__ T* at(const Common& c, int64_t offset) {
  return reinterpret_cast<T*>(c.sym + offset);
}

// Waits until this PE's signal word `w` satisfies `ready`, for at most the
// timeout. NVSHMEM's nvshmem_uint64_wait_until has no deadline, so the word
// is polled here; once ready, nvshmem_uint64_wait_until on the value seen
// (signal words only grow within a round) returns at once and gives the
// ordering NVSHMEM promises between the signal and the data it covers, on
// every transport. Returns false after a timeout, recorded once and naming
// peer_of(last value seen); once any timeout is recorded every wait returns
// false at once, so a dead peer costs one timeout, not one per phase.
template <typename PeerOf, typename Ready>
__device__ bool wait_signal(const Common& c, uint64_t* w, Phase phase, PeerOf peer_of, Ready ready,
                            uint64_t* seen) {
  uint64_t v = load_acquire_sys(w);
  if (!ready(v)) {
    if (timed_out_before(c.error)) return false;
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 1;; ++spins) {
      v = load_acquire_sys(w);
      if (ready(v)) break;
      if ((spins & 1023u) == 0) {
        if (global_timer_ns() - start > c.timeout_ns) {
          record_error(c.error, ErrorCode::kTimeout, phase, peer_of(v),
                       static_cast<int64_t>(c.timeout_ns / 1000000000ull), 0);
          return false;
        }
        if (timed_out_before(c.error)) return false;
      }
    }
  }
  nvshmem_uint64_wait_until(w, NVSHMEM_CMP_GE, v);
  *seen = v;
  return true;
}

// m of this call: bound_m clamped to [0, min(T, input rows)].
__device__ __forceinline__ int64_t clamped_m(const Common& c, const int32_t* bound_m,
                                             int64_t input_rows, bool* bad, int32_t* raw,
                                             int64_t* bound) {
  *bound = input_rows < c.geo.max_num_tokens ? input_rows : c.geo.max_num_tokens;
  *raw = *bound_m;
  return clamp_m(*raw, *bound, bad);
}

}  // namespace moelink::detail::shmem
