// Dispatch over NVSHMEM (protocol: docs/nvshmem.md).
//
// dispatch_send, warp-specialized: in every block, warp 0 counts this
// rank's routes to the experts the block owns (e = block + q * blocks) and
// signals each expert's rank with count + 1 (nvshmemx_signal_op, SET): the
// receiver then knows how many chunks to expect, zero included. The other
// warps pack each of the block's tokens once (header, validated expert ids,
// token row, scales) into this rank's send chunks, then send every chunk
// to each distinct expert it is routed to with nvshmemx_putmem_signal_nbi_warp
// into the private region (this rank, local expert) on the expert's rank,
// at a position taken from a local counter, adding 1 to that region's
// "arrived" counter. No quiet, no fence: the receiver waits for the counts.
//
// dispatch_recv: each block owns some (source, local expert) regions,
// waits for their counts and for that many arrivals, clears both counters,
// then its warps copy the chunks into the expert rows (rows taken with
// atomics on out_expert_num_tokens) and note where each route's expert
// output must go back (CombineItem).
#include <cooperative_groups.h>

#include "nvlink/cuda_check.h"
#include "nvshmem/device.cuh"

namespace moelink::detail::shmem {
namespace {

constexpr int kPackers = kWarps - 1;  // warps 1.. pack and send; warp 0 counts
constexpr int kHist = 2048;           // owned experts one counting pass covers
constexpr int kUnroll = 4;            // 16-byte vectors each lane keeps in flight
constexpr int kPairsPerPass = kThreadsPerBlock;

struct SendInfo {
  int64_t m;
  int replica;        // this rank's index in its DP group: it sends t = replica + u * dp_size
  int64_t my_tokens;  // how many u
};

__device__ SendInfo send_info(const DispatchParams& p, bool report) {
  const Geometry& g = p.c.geo;
  bool bad = false;
  int32_t raw = 0;
  int64_t bound = 0;
  SendInfo s;
  s.m = clamped_m(p.c, p.bound_m, p.input_rows, &bad, &raw, &bound);
  if (bad && report)
    record_error(p.c.error, ErrorCode::kBoundMTooLarge, Phase::kDispatchSend, -1, raw, bound);
  s.replica = g.rank % g.dp_size;
  s.my_tokens = s.m > s.replica ? (s.m - s.replica + g.dp_size - 1) / g.dp_size : 0;
  return s;
}

// Expert id of route i of token t, or -1 (no route, or an id outside
// [0, E), recorded when `report`).
__device__ __forceinline__ int64_t route_id(const DispatchParams& p, int64_t t, int i,
                                            bool report) {
  const Geometry& g = p.c.geo;
  const int64_t e = load_expert_id(p.indices.data, p.indices.dtype,
                                   t * p.indices.stride0 + i * p.indices.stride1);
  const RouteKind kind = classify_route(e, g.num_experts);
  if (kind == RouteKind::kInvalid && report)
    record_error(p.c.error, ErrorCode::kBadExpertId, Phase::kDispatchSend, -1, e,
                 t * g.experts_per_token + i);
  return kind == RouteKind::kValid ? e : -1;
}

// Warp 0 of each block: one lane per token, counting the distinct (token,
// expert) pairs for the experts this block owns, then one signal per owned
// expert. Experts beyond kHist per block take further passes.
__device__ void count_and_signal(const DispatchParams& p, const SendInfo& s) {
  __shared__ int hist[kHist];
  const Geometry& g = p.c.geo;
  const int lane = lane_id(), k = g.experts_per_token;
  const int64_t blocks = gridDim.x, block = blockIdx.x;
  const int64_t owned = block < g.num_experts ? (g.num_experts - block + blocks - 1) / blocks : 0;
  for (int64_t q0 = 0; q0 < owned; q0 += kHist) {
    const int64_t n = owned - q0 < kHist ? owned - q0 : kHist;
    for (int q = lane; q < n; q += 32) hist[q] = 0;
    __syncwarp();
    for (int64_t u = lane; u < s.my_tokens; u += 32) {
      const int64_t t = s.replica + u * g.dp_size;
      int64_t ids[kMaxTopK];
#pragma unroll
      for (int i = 0; i < kMaxTopK; ++i) ids[i] = i < k ? route_id(p, t, i, false) : -1;
#pragma unroll
      for (int i = 0; i < kMaxTopK; ++i) {
        const int64_t e = ids[i];
        if (e < 0 || e % blocks != block) continue;
        bool first = true;
#pragma unroll
        for (int i2 = 0; i2 < kMaxTopK; ++i2) first = first && !(i2 < i && ids[i2] == e);
        const int64_t q = e / blocks - q0;
        if (first && q >= 0 && q < n) atomicAdd(&hist[q], 1);
      }
    }
    __syncwarp();
    for (int q = lane; q < n; q += 32) {
      const int64_t e = block + (q0 + q) * blocks;
      const int r = g.rank_of_expert(e);
      const int j = static_cast<int>(e - static_cast<int64_t>(r) * g.num_local_experts);
      nvshmemx_signal_op(at<uint64_t>(p.c, p.c.lay.dispatch_count(g, g.rank, j)),
                         static_cast<uint64_t>(hist[q]) + 1, NVSHMEM_SIGNAL_SET, r);
    }
    __syncwarp();
  }
}

// Copies 16-byte vectors [begin, end) of a row.
__device__ __forceinline__ void copy_vectors(char* dst, const char* src, int64_t begin,
                                             int64_t end, int lane) {
  for (int64_t base = begin; base < end; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < end) v[u] = load_input_16(src + i * 16);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < end) store_16(dst + i * 16, v[u]);
    }
  }
}

// Warps 1.. of each block: pack the block's tokens (u = block + a * blocks)
// into send chunks, rows split over the warps when the block has few, then
// send each (token, distinct expert) pair with one warp-wide put.
__device__ void pack_and_send(const DispatchParams& p, const SendInfo& s) {
  const Geometry& g = p.c.geo;
  const ShmemLayout& lay = p.c.lay;
  const int lane = lane_id(), packer = (threadIdx.x >> 5) - 1, k = g.experts_per_token;
  const int64_t blocks = gridDim.x, block = blockIdx.x;
  const int64_t n_block = s.my_tokens > block ? (s.my_tokens - block + blocks - 1) / blocks : 0;
  const int64_t nvec = g.token_bytes / 16;
  const RowSplit split = split_rows(n_block, nvec, 32 * kUnroll, kPackers);
  for (int64_t unit = packer; unit < n_block * split.pieces; unit += kPackers) {
    const RowSplit::Piece pc = split.piece(unit);
    const int64_t u = block + pc.item * blocks;
    const int64_t t = s.replica + u * g.dp_size;
    char* chunk = at(p.c, lay.send_chunk(u));
    copy_vectors(chunk + lay.chunk_token_offset, p.x + t * p.x_row_bytes, pc.begin, pc.end, lane);
    if (pc.index == 0) {
      if (lane == 0) reinterpret_cast<ChunkHeader*>(chunk)->token = static_cast<uint32_t>(t);
      if (lane < k)
        reinterpret_cast<int32_t*>(chunk + lay.chunk_ids_offset)[lane] =
            static_cast<int32_t>(route_id(p, t, lane, true));
      float* scales = reinterpret_cast<float*>(chunk + lay.chunk_scale_offset);
      for (int i = lane; i < g.hidden_dim_scale; i += 32)
        scales[i] = p.x_scale[t * p.x_scale_s0 + i * p.x_scale_s1];
    }
  }
  // Every chunk of the block is complete (and visible to the NIC, which
  // reads it on network transports) before any warp sends one.
  __threadfence();
  asm volatile("bar.sync 1, %0;" ::"r"(kPackers * 32) : "memory");

  for (int64_t pi = packer; pi < n_block * k; pi += kPackers) {
    const int64_t a = pi / k;
    const int i = static_cast<int>(pi - a * k);
    const int64_t u = block + a * blocks;
    const char* chunk = at<const char>(p.c, lay.send_chunk(u));
    const int32_t id = lane < k ? reinterpret_cast<const int32_t*>(chunk + lay.chunk_ids_offset)[lane] : -1;
    const int32_t e = __shfl_sync(0xffffffffu, id, i);
    // A repeated expert travels once, with the first of its route slots.
    const bool repeat = __ballot_sync(0xffffffffu, lane < i && id == e) != 0;
    if (e < 0 || repeat) continue;
    const int r = g.rank_of_expert(e);
    const int j = e - r * g.num_local_experts;
    int pos = 0;
    if (lane == 0) pos = atomicAdd(&p.c.positions[e], 1);
    pos = __shfl_sync(0xffffffffu, pos, 0);
    nvshmemx_putmem_signal_nbi_warp(at(p.c, lay.recv_chunk(g, g.rank, j, pos)), chunk,
                                    lay.chunk_bytes,
                                    at<uint64_t>(p.c, lay.dispatch_arrived(g, g.rank, j)), 1,
                                    NVSHMEM_SIGNAL_ADD, r);
  }
}

__device__ void dispatch_send_part(const DispatchParams& p) {
  const SendInfo s = send_info(p, blockIdx.x == 0 && threadIdx.x == 0);
  if (blockIdx.x == 0) {
    // What the receive half accumulates into (it runs after this kernel on
    // the stream, or after the grid-wide sync of a fused launch).
    for (int j = threadIdx.x; j < p.c.geo.num_local_experts; j += blockDim.x) p.out_num_tokens[j] = 0;
    if (threadIdx.x == 0) {
      p.c.state->num_items = 0;
      p.c.state->dispatch_m = static_cast<int32_t>(s.m);
    }
  }
  if (threadIdx.x < 32)
    count_and_signal(p, s);
  else
    pack_and_send(p, s);
}

// Exclusive prefix sum over the block; *total gets the sum. Every thread calls.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[kWarps];
  const int lane = lane_id(), warp = threadIdx.x >> 5;
  int64_t inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  int64_t before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    sum += warp_sums[w];
  }
  __syncthreads();
  *total = sum;
  return before + inc - v;
}

// Fans chunk c of region (source s, local expert j) out to the rows of
// expert j, one per route of the token to it, and lists the routes for
// the combine. Called by a whole warp.
__device__ void receive_chunk(const DispatchParams& p, int s, int j, int64_t c) {
  const Geometry& g = p.c.geo;
  const ShmemLayout& lay = p.c.lay;
  const int lane = lane_id(), k = g.experts_per_token;
  const char* chunk = at<const char>(p.c, lay.recv_chunk(g, s, j, c));
  const uint32_t t = reinterpret_cast<const ChunkHeader*>(chunk)->token;
  const int32_t here = g.rank * g.num_local_experts + j;
  const int32_t id = lane < k ? reinterpret_cast<const int32_t*>(chunk + lay.chunk_ids_offset)[lane] : -1;
  const uint32_t mask = __ballot_sync(0xffffffffu, lane < k && id == here);
  const int mult = __popc(mask);
  if (mult == 0 || t >= g.max_num_tokens) return;  // never sent so; a corrupt chunk is skipped
  int64_t base = 0;
  int kept = 0, first_item = 0;
  if (lane == 0) {
    base = atomicAdd(&p.out_num_tokens[j], mult);
    const int64_t room = g.expert_capacity - base;
    kept = room <= 0 ? 0 : (room < mult ? static_cast<int>(room) : mult);
    if (kept < mult) {
      // Give the excess back: the first takers got rows < C, so the count
      // settles at exactly C.
      atomicSub(&p.out_num_tokens[j], mult - kept);
      record_error(p.c.error, ErrorCode::kExpertOverflow, Phase::kDispatchRecv, -1, j,
                   g.expert_capacity);
    }
    first_item = atomicAdd(&p.c.state->num_items, mult);
  }
  base = __shfl_sync(0xffffffffu, base, 0);
  kept = __shfl_sync(0xffffffffu, kept, 0);
  first_item = __shfl_sync(0xffffffffu, first_item, 0);
  if ((mask >> lane) & 1u) {
    const int n = __popc(mask & lanes_below());
    const int64_t q = first_item + n;
    if (q < lay.stage_rows)
      p.c.items[q] = CombineItem{j, n < kept ? static_cast<int32_t>(base + n) : -1, s / g.dp_size,
                                 static_cast<int32_t>(t) * kMaxTopK + lane};
  }
  if (kept == 0) return;
  // Lane d < kept: row base + d of expert j.
  char* dst = lane < kept ? p.out_x + j * p.out_x_s0_bytes + (base + lane) * p.out_x_s1_bytes : nullptr;
  // Plain loads: the chunk was put here by a peer during this dispatch.
  copy_row_to_lanes<kUnroll, false>(chunk + lay.chunk_token_offset, 0, g.token_bytes / 16, dst,
                                    kept, lane);
  const float* scales = reinterpret_cast<const float*>(chunk + lay.chunk_scale_offset);
  for (int i = lane; i < g.hidden_dim_scale; i += 32) {
    const float v = scales[i];
    for (int d = 0; d < kept; ++d)
      p.out_scale[j * p.out_scale_s0 + (base + d) * p.out_scale_s1 + i * p.out_scale_s2] = v;
  }
}

__device__ void dispatch_recv_part(const DispatchParams& p) {
  __shared__ int64_t first[kPairsPerPass + 1];
  __shared__ int32_t pair_of[kPairsPerPass];
  const Geometry& g = p.c.geo;
  const ShmemLayout& lay = p.c.lay;
  const int64_t pairs = static_cast<int64_t>(g.world_size) * g.num_local_experts;
  const int64_t blocks = gridDim.x, block = blockIdx.x;
  const int64_t owned = block < pairs ? (pairs - block + blocks - 1) / blocks : 0;
  const int warp = threadIdx.x >> 5;
  for (int64_t q0 = 0; q0 < owned; q0 += kPairsPerPass) {
    const int64_t n_pass = owned - q0 < kPairsPerPass ? owned - q0 : kPairsPerPass;
    int64_t n = 0;
    if (threadIdx.x < n_pass) {
      const int64_t pair = block + (q0 + threadIdx.x) * blocks;
      const int s = static_cast<int>(pair / g.num_local_experts);
      const int j = static_cast<int>(pair - static_cast<int64_t>(s) * g.num_local_experts);
      pair_of[threadIdx.x] = static_cast<int32_t>(pair);
      uint64_t* count = at<uint64_t>(p.c, lay.dispatch_count(g, s, j));
      uint64_t* arrived = at<uint64_t>(p.c, lay.dispatch_arrived(g, s, j));
      uint64_t v = 0;
      if (wait_signal(p.c, count, Phase::kDispatchRecv, [s](uint64_t) { return s; },
                      [](uint64_t x) { return x != 0; }, &v)) {
        n = static_cast<int64_t>(v - 1) < lay.tokens_per_replica ? static_cast<int64_t>(v - 1)
                                                                  : lay.tokens_per_replica;
        uint64_t a = 0;
        const uint64_t want = static_cast<uint64_t>(n);
        if (n > 0 && !wait_signal(p.c, arrived, Phase::kDispatchRecv, [s](uint64_t) { return s; },
                                  [want](uint64_t x) { return x >= want; }, &a))
          n = 0;
        // Both counters of this round are spent. The next round's senders
        // write them only after this rank entered its combine send.
        *reinterpret_cast<volatile uint64_t*>(count) = 0;
        *reinterpret_cast<volatile uint64_t*>(arrived) = 0;
      }
    }
    int64_t total = 0;
    const int64_t before = block_exclusive_scan(threadIdx.x < n_pass ? n : 0, &total);
    if (threadIdx.x < n_pass) first[threadIdx.x] = before;
    if (threadIdx.x == 0) first[n_pass] = total;
    __syncthreads();
    for (int64_t c = warp; c < total; c += kWarps) {
      int lo = 0, hi = static_cast<int>(n_pass);  // last pair with first[lo] <= c
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (first[mid] <= c) lo = mid;
        else hi = mid;
      }
      const int64_t pair = pair_of[lo];
      const int s = static_cast<int>(pair / g.num_local_experts);
      const int j = static_cast<int>(pair - static_cast<int64_t>(s) * g.num_local_experts);
      receive_chunk(p, s, j, c - first[lo]);
    }
    __syncthreads();
  }
}

template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreadsPerBlock) dispatch_kernel(DispatchParams p) {
  if (kSend) dispatch_send_part(p);
  // Fused: the counts are reset before any block takes rows (cooperative launch).
  if (kSend && kRecv) cooperative_groups::this_grid().sync();
  if (kRecv) dispatch_recv_part(p);
}

}  // namespace

void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s) {
  const cudaError_t err = launch_halves(dispatch_kernel<true, true>, dispatch_kernel<true, false>,
                                        dispatch_kernel<false, true>, p, send, recv, blocks, s);
  if (err != cudaSuccess)
    throw_cuda_error(err, "launching the NVSHMEM dispatch kernel", __FILE__, __LINE__);
}

}  // namespace moelink::detail::shmem
