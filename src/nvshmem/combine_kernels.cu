// Combine over NVSHMEM (protocol: docs/nvshmem.md).
//
// combine_send: first tells every rank that this rank has entered combine
// send (nvshmemx_signal_op, ADD 1 on its barrier slot): its dispatch
// regions are read, the next dispatch may overwrite them. Then one warp per
// route the dispatch accepted: the expert's output row, rounded to
// out_dtype, is staged in symmetric memory and put with
// nvshmemx_putmem_signal_nbi_warp into the private row (token, route slot)
// on every replica of the token's DP group, setting the slot's bit in the
// token's counter. A route the dispatch dropped (expert full) sets the
// slot's "dropped" bit instead, so the token's rank never waits for it.
//
// combine_recv: one block per token waits until every valid route slot of
// the token is settled, sums the weighted rows in fp32 (+ out when
// accumulating), rounds once and clears the counter. Block 0 then holds the
// only global barrier of a round: it returns only once every rank has
// entered combine send, so no rank starts the next dispatch send while
// another still reads its dispatch regions.
#include "nvlink/cuda_check.h"
#include "nvshmem/device.cuh"

namespace moelink::detail::shmem {
namespace {

constexpr int kVecs = 4;  // 8-element vectors per lane in flight (send conversion)

// Converts row `src` of YT to out_dtype OutT into `dst` (one warp).
template <typename YT, typename OutT>
__device__ __forceinline__ void convert_row(char* dst, const char* src, int64_t nvec, int lane) {
  constexpr int64_t kIn = 8 * sizeof(YT);
  for (int64_t base = lane; base < nvec; base += 32 * kVecs) {
    float f[kVecs][8];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int64_t v = base + u * 32;
      if (v < nvec) Vec8<YT>::load(src + v * kIn, f[u]);
    }
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int64_t v = base + u * 32;
      if (v < nvec) Vec8<OutT>::store(dst + v * 16, f[u]);
    }
  }
}

template <typename YT, typename OutT>
__device__ void combine_send_part(const CombineParams& p) {
  const Geometry& g = p.c.geo;
  const ShmemLayout& lay = p.c.lay;
  const int lane = lane_id();
  if (blockIdx.x == 0)
    for (int r = threadIdx.x; r < g.world_size; r += blockDim.x)
      nvshmemx_signal_op(at<uint64_t>(p.c, lay.barrier(g.rank)), 1, NVSHMEM_SIGNAL_ADD, r);
  // The dispatch send of this round is over: clear its positions for the next.
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * blockDim.x + threadIdx.x; e < g.num_experts; e += threads)
    p.c.positions[e] = 0;

  const int64_t n_raw = p.c.state->num_items;
  const int64_t n = n_raw < lay.stage_rows ? n_raw : lay.stage_rows;
  const int64_t nvec = g.hidden_dim / 8;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t q = blockIdx.x * kWarps + (threadIdx.x >> 5); q < n; q += num_warps) {
    const CombineItem it = p.c.items[q];
    const int64_t t = it.token_slot / kMaxTopK;
    const int slot = it.token_slot % kMaxTopK;
    uint64_t* signal = at<uint64_t>(p.c, lay.token_signal(t));
    if (it.row >= 0) {
      char* stage = at(p.c, lay.combine_stage(g, q));
      convert_row<YT, OutT>(stage, p.y + it.local_expert * p.y_s0_bytes + it.row * p.y_s1_bytes,
                            nvec, lane);
      // The staged row is complete (and visible to a NIC) before it is put.
      __threadfence();
      __syncwarp();
      for (int d = 0; d < g.dp_size; ++d)
        nvshmemx_putmem_signal_nbi_warp(at(p.c, lay.combine_row(g, t, slot)), stage,
                                        g.combine_row_bytes, signal, route_arrived_bit(slot),
                                        NVSHMEM_SIGNAL_ADD, it.group * g.dp_size + d);
    } else if (lane == 0) {
      for (int d = 0; d < g.dp_size; ++d)
        nvshmemx_signal_op(signal, route_dropped_bit(slot), NVSHMEM_SIGNAL_ADD,
                           it.group * g.dp_size + d);
    }
  }
}

template <typename OutT>
__device__ void combine_recv_part(const CombineParams& p) {
  constexpr int kGroup = 4;  // source rows whose loads are in flight together
  __shared__ float weight[kMaxTopK];
  __shared__ int32_t slot_of[kMaxTopK];
  __shared__ int num_src;
  const Geometry& g = p.c.geo;
  const ShmemLayout& lay = p.c.lay;
  const int k = g.experts_per_token;
  bool bad = false;
  int32_t raw = 0;
  int64_t bound = 0;
  const int64_t m = clamped_m(p.c, p.bound_m, p.input_rows, &bad, &raw, &bound);
  if (bad && blockIdx.x == 0 && threadIdx.x == 0)
    record_error(p.c.error, ErrorCode::kBoundMTooLarge, Phase::kCombineRecv, -1, raw, bound);
  // Tokens whose routes the dispatch sent: their counters must be drained
  // even if this call's m were smaller (it is the same m by contract).
  const int64_t sent = p.c.state->dispatch_m;
  const int64_t last = m > sent ? m : sent;
  const int64_t nvec = g.hidden_dim / 8;

  for (int64_t t = blockIdx.x; t < last; t += gridDim.x) {
    if (threadIdx.x == 0) {
      uint32_t expect = 0;
      int64_t ids[kMaxTopK];
      for (int i = 0; i < k; ++i) {
        const int64_t e = load_expert_id(p.indices.data, p.indices.dtype,
                                         t * p.indices.stride0 + i * p.indices.stride1);
        ids[i] = e;
        if (t < sent && classify_route(e, g.num_experts) == RouteKind::kValid) expect |= 1u << i;
      }
      uint64_t v = 0;
      // On a timeout, name the rank of the first route slot still missing.
      auto missing_rank = [&](uint64_t seen) {
        const uint32_t open = expect & ~routes_settled(seen);
        return open ? g.rank_of_expert(ids[__ffs(open) - 1]) : -1;
      };
      if (expect == 0 ||
          !wait_signal(p.c, at<uint64_t>(p.c, lay.token_signal(t)), Phase::kCombineRecv,
                       missing_rank,
                       [expect](uint64_t x) { return (routes_settled(x) & expect) == expect; },
                       &v))
        v = 0;
      // The slots whose rows arrived (dropped routes add nothing), compacted.
      const uint32_t have = static_cast<uint32_t>(v) & expect;
      int n = 0;
      for (int i = 0; i < k; ++i)
        if ((have >> i) & 1u) {
          slot_of[n] = i;
          weight[n++] = static_cast<const float*>(p.weights.data)[t * p.weights.stride0 +
                                                                  i * p.weights.stride1];
        }
      num_src = t < m ? n : 0;
    }
    __syncthreads();
    if (t < m) {
      const int n = num_src;
      char* out = p.out + t * p.out_row_bytes;
      const char* rows = at<const char>(p.c, lay.combine_row(g, t, 0));
      for (int64_t vi = threadIdx.x; vi < nvec; vi += blockDim.x) {
        float acc[8] = {};
        if (p.accumulate) Vec8<OutT>::load(out + vi * 16, acc);
        for (int d0 = 0; d0 < n; d0 += kGroup) {
          uint4 raw_rows[kGroup];
#pragma unroll
          for (int d = 0; d < kGroup; ++d)
            if (d0 + d < n) raw_rows[d] = load_16(rows + slot_of[d0 + d] * g.combine_row_bytes + vi * 16);
#pragma unroll
          for (int d = 0; d < kGroup; ++d) {
            if (d0 + d >= n) break;
            float f[8];
            Vec8<OutT>::from_raw(&raw_rows[d], f);
            const float w = weight[d0 + d];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += w * f[e];
          }
        }
        Vec8<OutT>::store(out + vi * 16, acc);
      }
    }
    __syncthreads();
    // Spent; the next round's rows and bits come only after the barrier.
    if (threadIdx.x == 0 && t < sent)
      *reinterpret_cast<volatile uint64_t*>(at<uint64_t>(p.c, lay.token_signal(t))) = 0;
  }

  if (blockIdx.x == 0) {
    const uint64_t target = p.c.state->rounds_done + 1;
    for (int s = threadIdx.x; s < g.world_size; s += blockDim.x) {
      uint64_t v = 0;
      wait_signal(p.c, at<uint64_t>(p.c, lay.barrier(s)), Phase::kCombineRecv,
                  [s](uint64_t) { return s; }, [target](uint64_t x) { return x >= target; }, &v);
    }
    __syncthreads();
    if (threadIdx.x == 0) p.c.state->rounds_done = target;
  }
}

template <typename YT, typename OutT, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreadsPerBlock) combine_kernel(CombineParams p) {
  if (kSend) combine_send_part<YT, OutT>(p);
  if (kRecv) combine_recv_part<OutT>(p);
}

}  // namespace

void launch_combine(const CombineParams& p, bool send, bool recv, int blocks, cudaStream_t s) {
  const cudaError_t err = with_combine_types(p.y_dtype, p.out_dtype, [&](auto y, auto out) {
    using YT = typename decltype(y)::type;
    using OutT = typename decltype(out)::type;
    // The receive half does not read expert_y: one instantiation per out type.
    return launch_halves(combine_kernel<YT, OutT, true, true>, combine_kernel<YT, OutT, true, false>,
                         combine_kernel<OutT, OutT, false, true>, p, send, recv, blocks, s);
  });
  if (err != cudaSuccess)
    throw_cuda_error(err, "launching the NVSHMEM combine kernel", __FILE__, __LINE__);
}

}  // namespace moelink::detail::shmem
