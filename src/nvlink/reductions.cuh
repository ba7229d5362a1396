// Warp- and block-wide reductions the kernels share (router, attention,
// model): a butterfly over the warp's lanes, then over the block's warps
// through 32 shared slots. Every thread gets the result.
#pragma once

#include <cuda_runtime.h>

namespace moelink::detail {

struct Sum {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <class T>
  __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Min {
  template <class T>
  __device__ T operator()(T a, T b) const { return a < b ? a : b; }
};

template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, Sum{}); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, Max{}); }

// blockDim.x a multiple of 32; `shared` 32 slots, free to reuse on return.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  v = warp_reduce(v, op);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  __syncthreads();  // shared may still be read by the previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < warps; ++w) v = op(v, shared[w]);
  return v;
}

}  // namespace moelink::detail
