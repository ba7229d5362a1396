// Dispatch over NVLink (protocol: docs/design.md).
//
// dispatch_send: one warp per token; the warp reads the token's k routes,
// groups them by destination rank (__match_any_sync) and writes the token
// once to each destination's staging slot (group, token) through the
// peer-mapped pointer, together with the route entries for that rank. No
// count exchange is needed: slots are indexed by token, so the write address
// is known up front. Each block then adds one to its flag on every rank.
//
// dispatch_recv: waits for every rank's flag, then one warp per candidate
// slot fans the staged token out to the rows of its local experts, taking
// rows by atomically counting into out_expert_num_tokens (local atomics).
//
// Fused prefill (both halves, many rows): the blocks split into senders and
// receivers that run at once. A slot written by a single warp is published
// by a release store of its header with kSlotComplete set, so receivers fan
// it out while the rest is still in flight: NVLink and HBM work overlap.
#include "nvlink/cuda_check.h"
#include "nvlink/device_utils.cuh"

namespace moelink::detail {
namespace {

constexpr int kWarps = kThreadsPerBlock / 32;
constexpr int kUnroll = 4;      // 16-byte vectors each lane keeps in flight (send)
constexpr int kRecvUnroll = 8;  // same, for the receive fan-out (one warp per slot)

struct TokenRoute {
  int dest;           // destination rank, -1: no route
  int local_expert;   // j on dest
  float weight;
};

// Lane i < k loads route i of token t; validates it (recording bad ids).
__device__ TokenRoute load_route(const DispatchParams& p, int64_t t, int lane, bool report) {
  const Geometry& g = p.c.geo;
  TokenRoute r{-1, 0, 0.f};
  if (lane >= g.experts_per_token) return r;
  const int64_t e = load_expert_id(p.indices.data, p.indices.dtype,
                                   t * p.indices.stride0 + lane * p.indices.stride1);
  const RouteKind kind = classify_route(e, g.num_experts);
  if (kind == RouteKind::kInvalid && report)
    record_error(p.c.error, ErrorCode::kBadExpertId, Phase::kDispatchSend, -1, e,
                 t * g.experts_per_token + lane);
  if (kind != RouteKind::kValid) return r;
  r.dest = g.rank_of_expert(e);
  r.local_expert = static_cast<int>(e - static_cast<int64_t>(r.dest) * g.num_local_experts);
  r.weight = static_cast<const float*>(p.weights.data)[t * p.weights.stride0 +
                                                       lane * p.weights.stride1];
  return r;
}

// Zeroes what the receive half accumulates into.
__device__ void reset_receive_counts(const DispatchParams& p) {
  for (int j = threadIdx.x; j < p.c.geo.num_local_experts; j += blockDim.x) p.out_num_tokens[j] = 0;
  if (threadIdx.x == 0) p.c.state->num_valid = 0;
}

// Sends this rank's tokens using blocks [0, num_blocks) of the launch;
// `block` is this block's index among them.
__device__ void dispatch_send_part(const DispatchParams& p, uint32_t epoch, int block,
                                   int num_blocks, bool reset_counts) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  bool bad_m = false;
  const int64_t bound = p.input_rows < g.max_num_tokens ? p.input_rows : g.max_num_tokens;
  const int32_t m_raw = *p.bound_m;
  const int64_t m = clamp_m(m_raw, bound, &bad_m);
  if (block == 0) {
    if (bad_m && threadIdx.x == 0)
      record_error(p.c.error, ErrorCode::kBoundMTooLarge, Phase::kDispatchSend, -1, m_raw, bound);
    // The receive half runs after this (same stream, or after this rank's
    // own flag when fused).
    if (reset_counts) reset_receive_counts(p);
  }

  const int group = g.dp_group();
  const int replica = g.rank % g.dp_size;
  const int64_t warp = static_cast<int64_t>(block) * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(num_blocks) * kWarps;
  // This replica's tokens are t = replica + i * dp_size; each is split into
  // `pieces` ranges of its row so that small batches still use every warp.
  const int64_t my_tokens = m > replica ? (m - replica + g.dp_size - 1) / g.dp_size : 0;
  const int64_t nvec = g.token_bytes / 16;
  const RowSplit split = split_rows(my_tokens, nvec, 32 * kUnroll, num_warps);
  for (int64_t u = warp; u < my_tokens * split.pieces; u += num_warps) {
    const RowSplit::Piece pc = split.piece(u);
    const int64_t t = replica + pc.item * g.dp_size;
    const int64_t piece = pc.index, begin = pc.begin, end = pc.end;
    const TokenRoute r = load_route(p, t, lane, piece == 0);
    // Lanes with the same destination form one group; its lowest lane leads.
    const uint32_t same = __match_any_sync(0xffffffffu, r.dest);
    const bool leads = r.dest >= 0 && (same & lanes_below()) == 0;
    const uint32_t leaders = __ballot_sync(0xffffffffu, leads);
    const int num_dest = __popc(leaders);
    if (num_dest == 0) continue;
    char* slot = leads ? p.c.peers[r.dest] + g.staging_slot_offset(group, t) : nullptr;
    // Every routed lane writes its own route entry into its group's slot.
    char* group_slot = reinterpret_cast<char*>(__shfl_sync(
        0xffffffffu, reinterpret_cast<uintptr_t>(slot), r.dest >= 0 ? __ffs(same) - 1 : lane));
    // A slot written by one warp is published by its header (kSlotComplete,
    // release store, last); with several pieces only the flags publish it.
    const bool single_writer = split.pieces == 1;
    const uint32_t routes_here = static_cast<uint32_t>(__popc(same));
    if (r.dest >= 0 && piece == 0) {
      RouteEntry* entries = reinterpret_cast<RouteEntry*>(group_slot + g.slot_routes_offset);
      entries[__popc(same & lanes_below())] = RouteEntry{r.local_expert, r.weight};
      if (leads && !single_writer)
        *reinterpret_cast<SlotHeader*>(slot) =
            SlotHeader{epoch, routes_here, static_cast<uint32_t>(t), 0u};
    }
    // Lane d (< num_dest) holds the slot and route count of the d-th destination.
    char* my_slot = nullptr;
    uint32_t my_routes = 0;
    for (int d = 0; d < num_dest; ++d) {
      const int from = __fns(leaders, 0, d + 1);
      char* s = reinterpret_cast<char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(slot), from));
      const uint32_t n = __shfl_sync(0xffffffffu, routes_here, from);
      if (lane == d) {
        my_slot = s;
        my_routes = n;
      }
    }
    copy_row_to_lanes<kUnroll, true>(p.x + t * p.x_row_bytes, begin, end,
                                     lane < num_dest ? my_slot + g.slot_token_offset : nullptr,
                                     num_dest, lane);
    if (g.hidden_dim_scale > 0 && piece == 0) {
      for (int s0 = 0; s0 < g.hidden_dim_scale; s0 += 32) {
        const int s = s0 + lane;
        const float v = s < g.hidden_dim_scale ? p.x_scale[t * p.x_scale_s0 + s * p.x_scale_s1] : 0.f;
        for (int d = 0; d < num_dest; ++d) {
          float* dst = reinterpret_cast<float*>(
              reinterpret_cast<char*>(
                  __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_slot), d)) +
              g.slot_scale_offset);
          if (s < g.hidden_dim_scale) dst[s] = v;
        }
      }
    }
    if (single_writer) {
      if (lane < num_dest) reinterpret_cast<uint32_t*>(my_slot)[2] = static_cast<uint32_t>(t);
      __syncwarp();  // the release below covers every lane's writes to the slot
      if (lane < num_dest)
        store_release_sys(reinterpret_cast<uint64_t*>(my_slot),
                          slot_header_word(epoch, my_routes | kSlotComplete));
    }
  }

  // Every rank hears from every sender, even with nothing for it, so that
  // receivers learn m and never wait on silence. Block 0's release (the
  // caller's signal_block_done) publishes m.
  if (block == 0)
    for (int r = threadIdx.x; r < g.world_size; r += blockDim.x)
      reinterpret_cast<uint64_t*>(p.c.peers[r] + g.dispatch_m_offset)[g.rank] =
          dispatch_flag(epoch, static_cast<uint32_t>(m));
}

__device__ void receive_slot(const DispatchParams& p, int grp, int64_t t, uint32_t routes);

// Every block waits for all ranks, then records m per DP group in shared memory.
__device__ void wait_dispatch_flags(const DispatchParams& p, uint32_t epoch, int64_t* group_m) {
  const Geometry& g = p.c.geo;
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(p.c.local + g.dispatch_flags_offset);
  for (int gi = threadIdx.x; gi < g.num_dp_groups; gi += blockDim.x) group_m[gi] = 0;
  __syncthreads();
  const uint64_t* m_words = reinterpret_cast<const uint64_t*>(p.c.local + g.dispatch_m_offset);
  const uint64_t target = send_complete_count(epoch, gridDim.x);  // all ranks launch alike
  for (int s = threadIdx.x; s < g.world_size; s += blockDim.x) {
    wait_flag(p.c, flags, s, Phase::kDispatchRecv, [target](uint64_t v) { return v >= target; });
    const uint64_t f = m_words[s];
    if (dispatch_flag_epoch(f) == epoch)
      atomicMax(reinterpret_cast<unsigned long long*>(&group_m[g.dp_group_of(s)]),
                static_cast<unsigned long long>(dispatch_flag_m(f)));
  }
  __syncthreads();
}

__device__ void dispatch_recv_part(const DispatchParams& p, uint32_t epoch) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  __shared__ int64_t group_m[kMaxNvlinkWorldSize];
  wait_dispatch_flags(p, epoch, group_m);

  int64_t total = 0;
  for (int gi = 0; gi < g.num_dp_groups; ++gi) total += group_m[gi];
  const int64_t warp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t q = warp; q < total; q += num_warps) {
    int grp = 0;
    int64_t t = q;
    while (t >= group_m[grp]) t -= group_m[grp++];
    const uint64_t h = *reinterpret_cast<const uint64_t*>(p.c.local + g.staging_slot_offset(grp, t));
    if (slot_header_epoch(h) != epoch) continue;  // no route of token t to this rank
    receive_slot(p, grp, t, slot_header_routes(h));
  }
}

// Fans staged slot (grp, t), holding `routes` route entries (kSlotComplete
// may be set), out to the rows of its local experts. Called by a whole warp.
__device__ void receive_slot(const DispatchParams& p, int grp, int64_t t, uint32_t routes) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  const int k = g.experts_per_token;
  const char* slot = p.c.local + g.staging_slot_offset(grp, t);
  routes &= ~kSlotComplete;
  {
    const int n = static_cast<int>(routes < static_cast<uint32_t>(k) ? routes : k);
    const int64_t slot_id = static_cast<int64_t>(grp) * g.max_num_tokens + t;
    // Lane i < n takes a row in local expert j for route entry i.
    char* dst = nullptr;
    int j = 0;
    int64_t row = -1;
    if (lane < n) {
      j = reinterpret_cast<const RouteEntry*>(slot + g.slot_routes_offset)[lane].local_expert;
      // Senders validate ids; re-check so a corrupt slot can never index out of bounds.
      row = j >= 0 && j < g.num_local_experts ? atomicAdd(&p.out_num_tokens[j], 1) : -1;
      if (row >= g.expert_capacity) {
        // Give the row back: the first C takers all got rows < C, so the
        // count settles at exactly C and no kernel pass is needed to clamp it.
        atomicSub(&p.out_num_tokens[j], 1);
        record_error(p.c.error, ErrorCode::kExpertOverflow, Phase::kDispatchRecv, -1, j,
                     g.expert_capacity);
        row = -1;
      }
      p.c.route_rows[slot_id * k + lane] = static_cast<int32_t>(row);
      if (row >= 0) dst = p.out_x + j * p.out_x_s0_bytes + row * p.out_x_s1_bytes;
    }
    if (lane == 0) p.c.valid_slots[atomicAdd(&p.c.state->num_valid, 1)] = static_cast<int32_t>(slot_id);
    // Compact the lanes that got a row so lanes 0..kept-1 hold destinations.
    const uint32_t kept_mask = __ballot_sync(0xffffffffu, dst != nullptr);
    const int kept = __popc(kept_mask);
    char* my_dst = nullptr;
    int my_j = 0;
    int64_t my_row = 0;
    for (int d = 0; d < kept; ++d) {
      const int src_lane = __fns(kept_mask, 0, d + 1);
      char* a = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), src_lane));
      const int jj = __shfl_sync(0xffffffffu, j, src_lane);
      const int64_t rr = __shfl_sync(0xffffffffu, row, src_lane);
      if (lane == d) {
        my_dst = a;
        my_j = jj;
        my_row = rr;
      }
    }
    if (kept == 0) return;
    // Plain loads: the staging slot was written by a peer during this dispatch.
    copy_row_to_lanes<kRecvUnroll, false>(slot + g.slot_token_offset, 0, g.token_bytes / 16, my_dst,
                                          kept, lane);
    if (g.hidden_dim_scale > 0) {
      const float* src_scale = reinterpret_cast<const float*>(slot + g.slot_scale_offset);
      for (int s0 = 0; s0 < g.hidden_dim_scale; s0 += 32) {
        const int s = s0 + lane;
        const float v = s < g.hidden_dim_scale ? src_scale[s] : 0.f;  // read once
        for (int d = 0; d < kept; ++d) {
          const int jj = __shfl_sync(0xffffffffu, my_j, d);
          const int64_t rr = __shfl_sync(0xffffffffu, my_row, d);
          if (s < g.hidden_dim_scale)
            p.out_scale[jj * p.out_scale_s0 + rr * p.out_scale_s1 + s * p.out_scale_s2] = v;
        }
      }
    }
  }
}

// The receive half of a fused prefill dispatch, on blocks [first, gridDim.x):
// walks every slot (group, t < T) and fans it out as soon as it is complete,
// i.e. its header says so, or its sender has finished (then the header says
// whether the token has routes here at all). No wait for all ranks first.
__device__ void dispatch_recv_streaming(const DispatchParams& p, uint32_t epoch, int first) {
  const Geometry& g = p.c.geo;
  // Counts are reset by the first receiving block; the others wait for it.
  volatile uint32_t* reset_epoch = &p.c.state->counts_reset_epoch;
  if (blockIdx.x == first) {
    reset_receive_counts(p);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      *reset_epoch = epoch;
    }
  } else if (threadIdx.x == 0) {
    while (*reset_epoch != epoch) {
    }
    __threadfence();
  }
  __syncthreads();

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(p.c.local + g.dispatch_flags_offset);
  const uint64_t* m_words = reinterpret_cast<const uint64_t*>(p.c.local + g.dispatch_m_offset);
  const uint64_t target = send_complete_count(epoch, gridDim.x);
  const int64_t warp = static_cast<int64_t>(blockIdx.x - first) * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x - first) * kWarps;
  const int64_t slots = static_cast<int64_t>(g.num_dp_groups) * g.max_num_tokens;
  for (int64_t q = warp; q < slots; q += num_warps) {
    const int grp = static_cast<int>(q / g.max_num_tokens);
    const int64_t t = q - static_cast<int64_t>(grp) * g.max_num_tokens;
    const int sender = grp * g.dp_size + g.sender_replica(t);
    const uint64_t* header = reinterpret_cast<const uint64_t*>(p.c.local + g.staging_slot_offset(grp, t));
    uint64_t h = 0;
    bool present = false;
    if (lane_id() == 0) {
      const uint64_t start = global_timer_ns();
      for (uint32_t spins = 0;; ++spins) {
        h = load_acquire_sys(header);
        if (slot_header_epoch(h) == epoch && (slot_header_routes(h) & kSlotComplete)) {
          present = true;
          break;
        }
        if (load_acquire_sys(flags + sender) >= target) {
          h = load_acquire_sys(header);  // final now: the sender is done
          const uint64_t mw = m_words[sender];
          present = slot_header_epoch(h) == epoch && dispatch_flag_epoch(mw) == epoch &&
                    t < static_cast<int64_t>(dispatch_flag_m(mw));
          break;
        }
        if ((spins & 1023u) == 1023u &&
            (timed_out_before(p.c.error) || global_timer_ns() - start > p.c.timeout_ns)) {
          record_error(p.c.error, ErrorCode::kTimeout, Phase::kDispatchRecv, sender,
                       static_cast<int64_t>(p.c.timeout_ns / 1000000000ull), 0);
          break;
        }
      }
    }
    present = __shfl_sync(0xffffffffu, present, 0);
    h = __shfl_sync(0xffffffffu, h, 0);
    if (present) receive_slot(p, grp, t, slot_header_routes(h));
  }
}

// The send half starts a new epoch; the receive half uses the finished one.
template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreadsPerBlock) dispatch_kernel(DispatchParams p) {
  const uint32_t epoch = finished_epoch(p.c) + (kSend ? 1u : 0u);
  if (kSend && kRecv && p.recv_blocks > 0) {
    // Prefill: senders and receivers at once (cooperative launch).
    const int senders = gridDim.x - p.recv_blocks;
    if (blockIdx.x < senders) dispatch_send_part(p, epoch, blockIdx.x, senders, false);
    signal_block_done(p.c, p.c.geo.dispatch_flags_offset);  // every block counts
    if (blockIdx.x >= senders) dispatch_recv_streaming(p, epoch, senders);
    return;
  }
  if (kSend) {
    dispatch_send_part(p, epoch, blockIdx.x, gridDim.x, true);
    signal_block_done(p.c, p.c.geo.dispatch_flags_offset);
  }
  if (kRecv) dispatch_recv_part(p, epoch);
}

}  // namespace

void launch_dispatch(const DispatchParams& p, bool send, bool recv, int blocks, cudaStream_t s) {
  const cudaError_t err = launch_halves(dispatch_kernel<true, true>, dispatch_kernel<true, false>,
                                        dispatch_kernel<false, true>, p, send, recv, blocks, s);
  if (err != cudaSuccess)
    throw_cuda_error(err, "launching the dispatch kernel", __FILE__, __LINE__);
}

}  // namespace moelink::detail
