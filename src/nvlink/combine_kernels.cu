// Combine over NVLink (protocol: docs/design.md).
//
// combine_send: for every staging slot the dispatch accepted, sum the
// weighted expert outputs of the token's local routes in fp32, round the
// share to out_dtype and write it to row (this rank, token) on every rank of
// the token's DP group. Each block then adds one to its flag on every rank.
//
// combine_recv: wait for every rank (the one global barrier of a round),
// then add, per token, the shares of the distinct ranks that held its routes.
//
// Both are bound by load latency, not bandwidth, at decode sizes: rows are
// split across warps when there are few items, and each lane issues the
// loads of up to kGroup sources x kVecs vectors before using any of them.
#include "nvlink/cuda_check.h"
#include "nvlink/device_utils.cuh"

namespace moelink::detail {
namespace {

constexpr int kWarps = kThreadsPerBlock / 32;
constexpr int kGroup = 4;  // sources loaded together
// 8-element vectors per lane per step: 64 bytes of 16-bit rows (4 sources x
// 4 words in flight), 32 bytes of fp32 rows (register budget).
template <typename T>
constexpr int kVecs = Vec8<T>::kWords == 1 ? 4 : 2;

// acc[u] += sum over sources d in [0, n) of w_d * row_d[v_u], where lane d of
// the warp holds (src, w) of source d. Row elements are of type T. All loads
// of a group of sources are issued before any is used.
template <typename T>
__device__ __forceinline__ void add_sources(float (&acc)[kVecs<T>][8], const char* my_src,
                                            float my_w, int n, int64_t base, int64_t end,
                                            int lane) {
  constexpr int V = kVecs<T>, kW = Vec8<T>::kWords;
  for (int d0 = 0; d0 < n; d0 += kGroup) {
    uint4 raw[kGroup][V][kW];
    float w[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int d = d0 + i;
      const char* s = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_src), d & 31));
      w[i] = d < n ? __shfl_sync(0xffffffffu, my_w, d & 31) : 0.f;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int64_t v = base + u * 32 + lane;
#pragma unroll
        for (int q = 0; q < kW; ++q)
          raw[i][u][q] = d < n && v < end ? load_16(s + v * 16 * kW + q * 16) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
#pragma unroll
      for (int u = 0; u < V; ++u) {
        float f[8];
        Vec8<T>::from_raw(raw[i][u], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] += w[i] * f[e];
      }
  }
}

template <typename YT, typename OutT>
__device__ void combine_send_part(const CombineParams& p) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  const int64_t num_valid = p.c.state->num_valid;
  const int k = g.experts_per_token;
  const int64_t warp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t nvec = g.hidden_dim / 8;
  constexpr int V = kVecs<YT>;
  const RowSplit split = split_rows(num_valid, nvec, 32 * V, num_warps);

  for (int64_t u = warp; u < num_valid * split.pieces; u += num_warps) {
    const RowSplit::Piece pc = split.piece(u);
    const int64_t q = pc.item, begin = pc.begin, end = pc.end;
    const int64_t slot_id = p.c.valid_slots[q];
    const int grp = static_cast<int>(slot_id / g.max_num_tokens);
    const int64_t t = slot_id - static_cast<int64_t>(grp) * g.max_num_tokens;
    const char* slot = p.c.local + g.staging_slot_offset(grp, t);
    const uint32_t n_raw = reinterpret_cast<const SlotHeader*>(slot)->num_routes & ~kSlotComplete;
    const int n = static_cast<int>(n_raw < static_cast<uint32_t>(k) ? n_raw : k);
    // Lanes 0..kept-1 end up holding (expert output row, weight) of the
    // routes that got a row in dispatch.
    const char* src = nullptr;
    float w = 0.f;
    if (lane < n) {
      const RouteEntry e = reinterpret_cast<const RouteEntry*>(slot + g.slot_routes_offset)[lane];
      const int32_t row = p.c.route_rows[slot_id * k + lane];
      if (row >= 0) {
        src = p.y + e.local_expert * p.y_s0_bytes + row * p.y_s1_bytes;
        w = e.weight;
      }
    }
    const uint32_t kept_mask = __ballot_sync(0xffffffffu, src != nullptr);
    const int kept = __popc(kept_mask);
    const int from = lane < kept ? __fns(kept_mask, 0, lane + 1) : lane;
    const char* my_src = reinterpret_cast<const char*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), from));
    const float my_w = __shfl_sync(0xffffffffu, w, from);
    // Lane d (< dp_size) holds row (rank, t) on replica d of the token's group.
    char* my_dst = lane < g.dp_size
                       ? p.c.peers[grp * g.dp_size + lane] + g.combine_row_offset(g.rank, t)
                       : nullptr;
    for (int64_t base = begin; base < end; base += 32 * V) {
      float acc[V][8] = {};
      add_sources<YT>(acc, my_src, my_w, kept, base, end, lane);
      for (int d = 0; d < g.dp_size; ++d) {
        char* dst = reinterpret_cast<char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_dst), d & 31));
#pragma unroll
        for (int u = 0; u < V; ++u) {
          const int64_t v = base + u * 32 + lane;
          if (v < end) Vec8<OutT>::store(dst + v * 16, acc[u]);
        }
      }
    }
  }

  signal_block_done(p.c, g.combine_flags_offset);
}

template <typename OutT>
__device__ void combine_recv_part(const CombineParams& p, uint32_t epoch) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(p.c.local + g.combine_flags_offset);
  const uint64_t target = send_complete_count(epoch, gridDim.x);  // all ranks launch alike
  for (int s = threadIdx.x; s < g.world_size; s += blockDim.x)
    wait_flag(p.c, flags, s, Phase::kCombineRecv, [target](uint64_t v) { return v >= target; });
  __syncthreads();

  bool bad_m = false;
  const int64_t bound = p.input_rows < g.max_num_tokens ? p.input_rows : g.max_num_tokens;
  const int32_t m_raw = *p.bound_m;
  const int64_t m = clamp_m(m_raw, bound, &bad_m);
  if (bad_m && blockIdx.x == 0 && threadIdx.x == 0)
    record_error(p.c.error, ErrorCode::kBoundMTooLarge, Phase::kCombineRecv, -1, m_raw, bound);

  const int k = g.experts_per_token;
  const int64_t warp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t nvec = g.hidden_dim / 8;
  constexpr int V = kVecs<OutT>;
  const RowSplit split = split_rows(m, nvec, 32 * V, num_warps);
  for (int64_t u = warp; u < m * split.pieces; u += num_warps) {
    const RowSplit::Piece pc = split.piece(u);
    const int64_t t = pc.item, begin = pc.begin, end = pc.end;
    int dest = -1;
    if (lane < k) {
      const int64_t e = load_expert_id(p.indices.data, p.indices.dtype,
                                       t * p.indices.stride0 + lane * p.indices.stride1);
      if (classify_route(e, g.num_experts) == RouteKind::kValid) dest = g.rank_of_expert(e);
    }
    // The distinct ranks holding the token's routes: lane d gets the d-th.
    const uint32_t same = __match_any_sync(0xffffffffu, dest);
    const uint32_t leaders = __ballot_sync(0xffffffffu, dest >= 0 && (same & lanes_below()) == 0);
    const int num_src = __popc(leaders);
    const int from = lane < num_src ? __fns(leaders, 0, lane + 1) : lane;
    const int src_rank = __shfl_sync(0xffffffffu, dest, from);
    const char* my_row = lane < num_src ? p.c.local + g.combine_row_offset(src_rank, t) : nullptr;
    char* out = p.out + t * p.out_row_bytes;
    for (int64_t base = begin; base < end; base += 32 * V) {
      float acc[V][8] = {};
      if (p.accumulate) {
#pragma unroll
        for (int u = 0; u < V; ++u) {
          const int64_t v = base + u * 32 + lane;
          if (v < end) Vec8<OutT>::load(out + v * 16, acc[u]);
        }
      }
      add_sources<OutT>(acc, my_row, 1.0f, num_src, base, end, lane);
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v < end) Vec8<OutT>::store(out + v * 16, acc[u]);
      }
    }
  }
}

template <typename YT, typename OutT, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreadsPerBlock) combine_kernel(CombineParams p) {
  const uint32_t epoch = finished_epoch(p.c);
  if (kSend) combine_send_part<YT, OutT>(p);
  if (kRecv) combine_recv_part<OutT>(p, epoch);
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
  if (err != cudaSuccess) throw_cuda_error(err, "launching the combine kernel", __FILE__, __LINE__);
}

}  // namespace moelink::detail
