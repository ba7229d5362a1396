// Device-side building blocks shared by the dispatch and combine kernels:
// system-scope flag loads/stores, the wait-with-deadline, error recording,
// block-done signals, the epoch, row splitting, the warp's row copy to
// several destinations, the 8-element conversions combine uses and the
// launch helpers (one or both halves; the combine's element types).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "nvlink/kernels.h"

namespace moelink::detail {

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Streaming read of inputs that nobody writes while the kernel runs.
__device__ __forceinline__ uint4 load_input_16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 load_16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void store_16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// One warp copies 16-byte vectors [begin, end) of the row at `src` to the
// row held by each of lanes 0..num_dest-1 in `dst` (lane d's `dst` is
// destination d's row address): the source is read once, kUnroll vectors
// per lane in flight. kInput: `src` is an input nobody writes while the
// kernel runs (non-coherent loads); otherwise plain loads (memory a peer
// wrote during this launch).
template <int kUnroll, bool kInput>
__device__ __forceinline__ void copy_row_to_lanes(const char* src, int64_t begin, int64_t end,
                                                  char* dst, int num_dest, int lane) {
  for (int64_t base = begin; base < end; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < end) v[u] = kInput ? load_input_16(src + i * 16) : load_16(src + i * 16);
    }
    for (int d = 0; d < num_dest; ++d) {
      char* out = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), d));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < end) store_16(out + i * 16, v[u]);
      }
    }
  }
}

// First error wins; the host reads the record after synchronizing.
__device__ __forceinline__ void record_error(ErrorRecord* e, ErrorCode code, Phase phase, int peer,
                                             int64_t value, int64_t extra) {
  if (atomicCAS(&e->code, 0, static_cast<int32_t>(code)) == 0) {
    e->phase = static_cast<int32_t>(phase);
    e->peer = peer;
    e->value = value;
    e->extra = extra;
  }
}

__device__ __forceinline__ bool timed_out_before(const ErrorRecord* e) {
  return *reinterpret_cast<const volatile int32_t*>(&e->code) ==
         static_cast<int32_t>(ErrorCode::kTimeout);
}

// Threads 0..W-1 of the block each wait for flag slot `peer` to satisfy
// `ready(value)`; returns the value seen (0 after a timeout). Once a timeout
// has been recorded every later wait returns at once, so a dead peer costs
// one timeout, not one per phase.
template <typename Ready>
__device__ uint64_t wait_flag(const CommonParams& c, const uint64_t* flags, int peer, Phase phase,
                              Ready ready) {
  uint64_t v = load_acquire_sys(flags + peer);
  if (ready(v)) return v;  // the common case costs one load
  if (timed_out_before(c.error)) return 0;
  const uint64_t start = global_timer_ns();
  uint32_t spins = 0;
  while (true) {
    v = load_acquire_sys(flags + peer);
    if (ready(v)) return v;
    if ((++spins & 1023u) == 0) {
      if (global_timer_ns() - start > c.timeout_ns) {
        record_error(c.error, ErrorCode::kTimeout, phase, peer,
                     static_cast<int64_t>(c.timeout_ns / 1000000000ull), 0);
        return 0;
      }
      if (timed_out_before(c.error)) return 0;
    }
  }
}

__device__ __forceinline__ void add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Called by every thread once its block's sends are done: thread r adds one
// to this rank's slot of flag array `offset` on rank r. The release add
// (after the barrier, cumulative) publishes every write of the block before
// it. No block waits for any other: the receiver counts blocks.
__device__ __forceinline__ void signal_block_done(const CommonParams& c, int64_t offset) {
  __syncthreads();
  for (int r = threadIdx.x; r < c.geo.world_size; r += blockDim.x)
    add_release_sys(reinterpret_cast<uint64_t*>(c.peers[r] + offset) + c.geo.rank, 1);
}

// The epoch of the latest dispatch send this rank has finished, read from
// its own dispatch flag (its blocks add 1 each to it, like to every peer's):
// floor(count / blocks). Inside a dispatch send, blocks of the same launch
// that already signalled add fewer than `blocks`, so the floor still gives
// the previous epoch: no grid-wide step is needed to advance the epoch, and
// graph replays advance it by themselves.
__device__ __forceinline__ uint32_t finished_epoch(const CommonParams& c) {
  const uint64_t own = *reinterpret_cast<const volatile uint64_t*>(
      c.local + c.geo.dispatch_flags_offset + 8 * c.geo.rank);
  return static_cast<uint32_t>(own / gridDim.x);
}

// Eight consecutive elements of bf16 / fp16 / fp32 rows as fp32.
template <typename T>
struct Vec8;
// kWords: 16-byte words per 8 elements; from_raw converts words already
// loaded, so callers can issue many loads before converting any. The two
// 16-bit types differ only in their pair type and its conversions.
__device__ __forceinline__ float2 pair_to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 pair_to_float2(__half2 v) { return __half22float2(v); }
template <typename Pair>
__device__ __forceinline__ Pair float2_to_pair(float a, float b);
template <>
__device__ __forceinline__ __nv_bfloat162 float2_to_pair<__nv_bfloat162>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ __half2 float2_to_pair<__half2>(float a, float b) {
  return __floats2half2_rn(a, b);
}

template <typename Pair>
struct Vec8Of16Bit {
  static constexpr int kWords = 1;
  static __device__ __forceinline__ void from_raw(const uint4* w, float* f) {
    const Pair* h = reinterpret_cast<const Pair*>(w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = pair_to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ void load(const void* p, float* f) {
    const uint4 v = load_16(p);
    from_raw(&v, f);
  }
  static __device__ __forceinline__ void store(void* p, const float* f) {
    uint4 v;
    Pair* h = reinterpret_cast<Pair*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = float2_to_pair<Pair>(f[2 * i], f[2 * i + 1]);
    store_16(p, v);
  }
};
template <>
struct Vec8<__nv_bfloat16> : Vec8Of16Bit<__nv_bfloat162> {};
template <>
struct Vec8<__half> : Vec8Of16Bit<__half2> {};
template <>
struct Vec8<float> {
  static constexpr int kWords = 2;
  static __device__ __forceinline__ void from_raw(const uint4* w, float* f) {
    const float* a = reinterpret_cast<const float*>(w);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = a[i];
  }
  static __device__ __forceinline__ void load(const void* p, float* f) {
    uint4 a = load_16(p), b = load_16(static_cast<const char*>(p) + 16);
    const float* fa = reinterpret_cast<const float*>(&a);
    const float* fb = reinterpret_cast<const float*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = fa[i];
      f[4 + i] = fb[i];
    }
  }
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// Splitting rows across warps. A warp handles `span` 16-byte vectors of one
// item (token or slot); with few items a row is split over several warps so
// that all warps have work and each lane keeps several loads in flight.
struct RowSplit {
  int64_t pieces;  // pieces per item
  int64_t span;    // vectors per piece, a multiple of `step`
  int64_t vectors;  // per item

  struct Piece {
    int64_t item;   // index of the token or slot
    int64_t index;  // which piece of it, 0..pieces-1
    int64_t begin, end;  // its vectors
  };
  // Work unit u (0 <= u < items * pieces).
  __device__ __forceinline__ Piece piece(int64_t u) const {
    const int64_t index = u % pieces;
    const int64_t begin = index * span;
    return Piece{u / pieces, index, begin, begin + span < vectors ? begin + span : vectors};
  }
};
__device__ __forceinline__ RowSplit split_rows(int64_t items, int64_t vectors, int64_t step,
                                               int64_t num_warps) {
  const int64_t steps = (vectors + step - 1) / step;
  int64_t pieces = items > 0 ? num_warps / items : 1;
  pieces = pieces < 1 ? 1 : (pieces > steps ? steps : pieces);
  const int64_t steps_per_piece = (steps + pieces - 1) / pieces;
  pieces = (steps + steps_per_piece - 1) / steps_per_piece;
  return RowSplit{pieces, steps_per_piece * step, vectors};
}
__device__ __forceinline__ uint32_t lanes_below() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Launches `kernel(params)` on `blocks` blocks; cooperatively when the
// kernel has blocks that wait for other blocks of the same launch.
template <typename Params>
cudaError_t launch_kernel(void (*kernel)(Params), const Params& params, int blocks,
                          bool cooperative, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreadsPerBlock);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = cooperative ? &attr : nullptr;
  cfg.numAttrs = cooperative ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, params);
}

// The send and receive halves of dispatch or combine: both in one
// cooperative launch (its receiving blocks wait for its sending ones), or
// one alone.
template <typename Params>
cudaError_t launch_halves(void (*both)(Params), void (*send_only)(Params),
                          void (*recv_only)(Params), const Params& p, bool send, bool recv,
                          int blocks, cudaStream_t stream) {
  if (send && recv) return launch_kernel(both, p, blocks, true, stream);
  if (send) return launch_kernel(send_only, p, blocks, false, stream);
  return launch_kernel(recv_only, p, blocks, false, stream);
}

// Calls f(TypeTag<YT>{}, TypeTag<OutT>{}) for the combine's element types:
// expert outputs YT of y_dtype (bf16, fp16, or else fp32), results OutT of
// out_dtype (fp16, or else bf16). One instantiation per pair, in one place
// for every backend.
template <typename T>
struct TypeTag {
  using type = T;
};
template <typename F>
cudaError_t with_combine_types(DType y_dtype, DType out_dtype, F&& f) {
  const auto for_out = [&](auto out) -> cudaError_t {
    switch (y_dtype) {
      case DType::kBFloat16: return f(TypeTag<__nv_bfloat16>{}, out);
      case DType::kFloat16: return f(TypeTag<__half>{}, out);
      default: return f(TypeTag<float>{}, out);
    }
  };
  return out_dtype == DType::kFloat16 ? for_out(TypeTag<__half>{})
                                      : for_out(TypeTag<__nv_bfloat16>{});
}

}  // namespace moelink::detail
