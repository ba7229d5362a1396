// Hopper's tensor-memory accelerator (TMA, sm_90) and the shared-memory
// transaction barriers (mbarrier) its copies complete on, for moelink's
// decode kernels (raw PTX). The tensor map a copy reads is made on the host
// (tma_map.h) and passed as a __grid_constant__ kernel argument.
//
// A barrier here has one arrival a phase: the thread that issues a group of
// copies arrives with the group's byte count (arrive_expect_tx), the copies
// complete the bytes, and the phase flips when both have happened; waiters
// spin on the phase's parity (fill k of a buffer: parity k & 1).
#pragma once

#include <cstdint>

namespace moelink::detail::attention::tma {

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// The barriers' initialization seen by the async proxy (the copies'
// complete_tx) before any copy is issued on them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Until the phase of `parity` has completed.
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "moelink_wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra moelink_wait;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The tensor map (a __grid_constant__ argument's generic address) into the
// cache before its first use.
__device__ __forceinline__ void prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The box at (inner, outer) of a 2-D tensor map -> shared memory at dst
// (aligned to the map's swizzle period), completing its bytes on `bar`.
__device__ __forceinline__ void load_2d(uint32_t dst, const void* map, int32_t inner, int32_t outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

}  // namespace moelink::detail::attention::tma
