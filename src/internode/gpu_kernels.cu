// The inter-node backend's kernels (protocol: protocol.h). They never wait
// for a peer: the stream waits for the proxy (stream memory operations on
// the pinned `done` word) between the pack and the unpack kernels, so no SM
// is held while the network works.
//
// Node peers' slots and rows are stored straight into their local areas
// over NVLink. The system-scope fence that ends each pack kernel orders
// those stores before the proxy's request, so before the notification the
// peer's proxy waits for; its unpack kernels start only after that.
//
// Reads of the pinned buffers, the plan and the local area use ld.cv: the
// host (proxy, NIC) or a peer GPU writes them between kernels and no GPU
// cache may serve an old copy.
#include <cub/block/block_scan.cuh>

#include "internode/gpu_kernels.h"
#include "nvlink/device_utils.cuh"

namespace moelink::detail::internode {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int64_t host_word(const int64_t* p) {
  return __ldcv(reinterpret_cast<const long long*>(p));
}
__device__ __forceinline__ uint4 host_16(const void* p) {
  return __ldcv(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ int64_t expert_at(const StridedMatrix& m, int64_t t, int i) {
  return load_expert_id(m.data, m.dtype, t * m.stride0 + i * m.stride1);
}
__device__ __forceinline__ float weight_at(const StridedMatrix& m, int64_t t, int i) {
  return static_cast<const float*>(m.data)[t * m.stride0 + i * m.stride1];
}

__device__ __forceinline__ int64_t global_warp() {
  return static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
}
__device__ __forceinline__ int64_t warp_count() { return static_cast<int64_t>(gridDim.x) * kWarps; }

// ---------------------------------------------------------------- handshake

// The epoch lives on the device so that graph replays advance it.
__global__ void next_epoch_kernel(GpuState s) { *s.epoch += 1; }

// Raises the proxy's request word to `step_of_epoch`: 2e - 1 (dispatch) or
// 2e (combine). The release store is ordered after the packing kernels'
// writes, which ended with a system-scope fence.
__global__ void request_kernel(GpuCommon c, int combine) {
  const uint64_t e = *c.state.epoch;
  store_release_sys(c.request, combine ? 2 * e : 2 * e - 1);
}

// ---------------------------------------------------------------- dispatch send

// Block (q, r): position of every token of replica q among q's tokens for
// rank r, in token order (an exclusive scan), and the count. Every replica
// computes every replica's positions: combine needs them (protocol step 6).
__global__ void __launch_bounds__(kThreads) route_scan_kernel(GpuDispatchParams p) {
  const Geometry& g = p.c.geo;
  const int W = g.world_size, dp = g.dp_size;
  const int q = blockIdx.x / W, r = blockIdx.x % W;
  const int64_t limit = g.max_num_tokens < p.input_rows ? g.max_num_tokens : p.input_rows;
  const int32_t raw_m = *p.bound_m;
  bool bad = false;
  const int64_t m = clamp_m(raw_m, limit, &bad);
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      *p.c.state.dispatch_m = static_cast<int32_t>(m);
      if (bad)
        record_error(p.c.state.error, ErrorCode::kBoundMTooLarge, Phase::kDispatchSend, -1, raw_m,
                     limit);
    }
    for (int j = threadIdx.x; j < g.num_local_experts; j += kThreads)
      p.c.state.expert_counter[j] = 0;
  }
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int64_t n_q = q < m ? (m - q + dp - 1) / dp : 0;
  int base = 0;
  for (int64_t u0 = 0; u0 < n_q; u0 += kThreads) {
    const int64_t u = u0 + threadIdx.x;
    const int64_t t = q + u * dp;
    int hit = 0;
    if (u < n_q)
      for (int i = 0; i < g.experts_per_token; ++i) {
        const int64_t e = expert_at(p.indices, t, i);
        if (classify_route(e, g.num_experts) == RouteKind::kValid && g.rank_of_expert(e) == r)
          hit = 1;
      }
    int prefix = 0, total = 0;
    Scan(scan).ExclusiveSum(hit, prefix, total);
    if (u < n_q) p.c.state.dest_index[t * W + r] = hit ? base + prefix : -1;
    base += total;
    __syncthreads();  // the scan storage is reused
  }
  if (threadIdx.x == 0) p.c.state.counts[q * W + r] = static_cast<uint32_t>(base);
}

// One warp per own token: a slot per destination rank, at the token's
// position in that rank's block. The blocks share out the headers at the
// front of every destination's block; block 0 also writes the pinned copy
// the proxy reads.
__global__ void __launch_bounds__(kThreads) pack_kernel(GpuDispatchParams p) {
  const uint32_t epoch = *p.c.state.epoch;
  const Geometry& g = p.c.geo;
  const Layout& l = p.c.layout;
  const int W = g.world_size, k = g.experts_per_token, lane = lane_id();
  const uint32_t* own = p.c.state.counts + (g.rank % g.dp_size) * W;
  extern __shared__ int64_t block_off[];  // [W]
  if (threadIdx.x == 0) {
    int64_t off = 0;
    for (int r = 0; r < W; ++r) {
      block_off[r] = off;
      off += l.header_bytes + own[r] * l.slot_bytes;
    }
  }
  const int64_t m = *p.c.state.dispatch_m;
  __syncthreads();
  // RouteHeader {epoch, m} then the W counts, as 32-bit words.
  static_assert(sizeof(RouteHeader) == 8);
  const auto header_word = [&](int w) {
    return w == 0 ? epoch : w == 1 ? static_cast<uint32_t>(m) : own[w - 2];
  };
  for (int r = blockIdx.x; r < W; r += gridDim.x) {
    uint32_t* h = reinterpret_cast<uint32_t*>(p.c.send + block_off[r]);
    for (int w = threadIdx.x; w < 2 + W; w += kThreads) h[w] = header_word(w);
  }
  if (blockIdx.x == 0)
    for (int w = threadIdx.x; w < 2 + W; w += kThreads)
      reinterpret_cast<uint32_t*>(p.c.own_header)[w] = header_word(w);
  const int mine = g.rank % g.dp_size;
  const int64_t n_mine = mine < m ? (m - mine + g.dp_size - 1) / g.dp_size : 0;
  for (int64_t u = global_warp(); u < n_mine; u += warp_count()) {
    const int64_t t = mine + u * g.dp_size;
    if (lane < k) {
      const int64_t e = expert_at(p.indices, t, lane);
      if (classify_route(e, g.num_experts) == RouteKind::kInvalid)
        record_error(p.c.state.error, ErrorCode::kBadExpertId, Phase::kDispatchSend, -1, e,
                     t * k + lane);
    }
    const char* x = p.x + t * p.x_row_bytes;
    for (int r0 = 0; r0 < W; r0 += 32) {
      const int r = r0 + lane;
      const int32_t j = r < W ? p.c.state.dest_index[t * W + r] : -1;
      uint32_t mask = __ballot_sync(0xffffffffu, j >= 0);
      while (mask) {
        const int b = __ffs(mask) - 1;
        mask &= mask - 1;
        const int dest = r0 + b;
        const int32_t jj = __shfl_sync(0xffffffffu, j, b);
        char* slot = l.is_local(g.rank, dest)
                         ? p.c.local_bases[l.local_index(dest)] + l.local_slot_offset(g.rank, jj)
                         : p.c.send + block_off[dest] + l.header_bytes + jj * l.slot_bytes;
        if (lane == 0) {
          RouteEntry* routes = reinterpret_cast<RouteEntry*>(slot + g.slot_routes_offset);
          uint32_t n = 0;
          for (int i = 0; i < k; ++i) {
            const int64_t e = expert_at(p.indices, t, i);
            if (classify_route(e, g.num_experts) != RouteKind::kValid ||
                g.rank_of_expert(e) != dest)
              continue;
            routes[n++] = RouteEntry{static_cast<int32_t>(e % g.num_local_experts),
                                     weight_at(p.weights, t, i)};
          }
          *reinterpret_cast<SlotHeader*>(slot) =
              SlotHeader{epoch, n, static_cast<uint32_t>(t), 0};
        }
        for (int64_t v = lane; v < g.token_bytes / 16; v += 32)
          store_16(slot + g.slot_token_offset + 16 * v, load_input_16(x + 16 * v));
        float* scales = reinterpret_cast<float*>(slot + g.slot_scale_offset);
        for (int s = lane; s < g.hidden_dim_scale; s += 32)
          scales[s] = p.x_scale[t * p.x_scale_s0 + s * p.x_scale_s1];
      }
    }
  }
  // The proxy reads the buffer once the stream's write of `request` lands.
  __threadfence_system();
}

// ---------------------------------------------------------------- dispatch recv

// One warp per received slot, in receive order: its routes get rows in the
// batched-experts layout; the token is read once and stored per route.
__global__ void __launch_bounds__(kThreads) unpack_kernel(GpuDispatchParams p) {
  const uint32_t epoch = *p.c.state.epoch;
  const Geometry& g = p.c.geo;
  const Layout& l = p.c.layout;
  const PlanView& pv = p.c.plan_view;
  const int W = g.world_size, k = g.experts_per_token, lane = lane_id();
  if (host_word(p.c.plan + kPlanDispatchEpoch) != epoch) return;
  int64_t received = host_word(p.c.plan + kPlanReceived);
  received = received < l.shared_slots ? received : l.shared_slots;
  for (int64_t i = global_warp(); i < received; i += warp_count()) {
    int sender = -1;
    for (int s0 = 0; s0 < W && sender < 0; s0 += 32) {
      const int s = s0 + lane;
      const bool hit = s < W && host_word(p.c.plan + pv.recv_base(s)) <= i &&
                       i < host_word(p.c.plan + pv.recv_base(s + 1));
      const uint32_t mask = __ballot_sync(0xffffffffu, hit);
      if (mask) sender = s0 + __ffs(mask) - 1;
    }
    if (lane == 0) p.c.state.recv_sender[i] = sender;
    if (sender < 0) {  // cannot happen with a consistent plan
      if (lane == 0) p.c.state.recv_routes_n[i] = 0;
      continue;
    }
    const int64_t j = i - host_word(p.c.plan + pv.recv_base(sender));
    const bool from_node = l.is_local(sender, g.rank);
    // check_receiver bounds every count by T = local_slots.
    if (from_node && j >= l.local_slots) {
      if (lane == 0) p.c.state.recv_routes_n[i] = 0;
      continue;
    }
    const char* slot =
        from_node ? p.c.local + l.local_slot_offset(sender, j)
              : p.c.recv +
                    l.recv_slot_offset(sender, j, host_word(p.c.plan + pv.shared_base(sender)));
    const uint4 hw = host_16(slot);
    const SlotHeader h = *reinterpret_cast<const SlotHeader*>(&hw);
    const uint32_t nk = static_cast<uint32_t>(k);
    const int n =
        h.epoch == epoch ? static_cast<int>(h.num_routes < nk ? h.num_routes : nk) : 0;
    int32_t local = -1, row = -1;
    if (lane < n) {
      const uint2 raw = __ldcv(reinterpret_cast<const uint2*>(slot + g.slot_routes_offset) + lane);
      const RouteEntry e = *reinterpret_cast<const RouteEntry*>(&raw);
      local = e.local_expert;
      if (local >= 0 && local < g.num_local_experts) {
        row = atomicAdd(p.c.state.expert_counter + local, 1);
        if (row >= g.expert_capacity) row = -1;  // reported by the count kernel
      }
      p.c.state.recv_routes[i * k + lane] = e;
      p.c.state.recv_rows[i * k + lane] = row;
    }
    if (lane == 0) p.c.state.recv_routes_n[i] = n;
    const uint32_t kept = __ballot_sync(0xffffffffu, row >= 0);
    const int64_t vecs = g.token_bytes / 16;
    for (int64_t v0 = 0; v0 < vecs; v0 += 32) {
      const int64_t v = v0 + lane;
      const uint4 val = v < vecs ? host_16(slot + g.slot_token_offset + 16 * v) : uint4{};
      for (uint32_t m = kept; m; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int32_t lb = __shfl_sync(0xffffffffu, local, b),
                      rb = __shfl_sync(0xffffffffu, row, b);
        if (v < vecs)
          store_16(p.out_x + lb * p.out_x_s0_bytes + rb * p.out_x_s1_bytes + 16 * v, val);
      }
    }
    for (int s0 = 0; s0 < g.hidden_dim_scale; s0 += 32) {
      const int s = s0 + lane;
      const float f = s < g.hidden_dim_scale
                          ? __ldcv(reinterpret_cast<const float*>(slot + g.slot_scale_offset) + s)
                          : 0.f;
      for (uint32_t m = kept; m; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int32_t lb = __shfl_sync(0xffffffffu, local, b),
                      rb = __shfl_sync(0xffffffffu, row, b);
        if (s < g.hidden_dim_scale)
          p.out_scale[lb * p.out_scale_s0 + rb * p.out_scale_s1 + s * p.out_scale_s2] = f;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) count_kernel(GpuDispatchParams p) {
  const uint32_t epoch = *p.c.state.epoch;
  const Geometry& g = p.c.geo;
  const bool ok = host_word(p.c.plan + kPlanDispatchEpoch) == epoch;
  for (int j = threadIdx.x; j < g.num_local_experts; j += kThreads) {
    const int32_t c = p.c.state.expert_counter[j];
    if (ok && c > g.expert_capacity)
      record_error(p.c.state.error, ErrorCode::kExpertOverflow, Phase::kDispatchRecv, -1, j,
                   g.expert_capacity);
    p.out_num_tokens[j] =
        ok ? (c < g.expert_capacity ? c : static_cast<int32_t>(g.expert_capacity)) : 0;
  }
}

// ---------------------------------------------------------------- combine

// One warp per received slot: the weighted sum of its routes' expert
// outputs, rounded once to out_dtype. Replicas of the slot's group in this
// node get it straight into their local area, at the row the proxy would
// have written; for the others it goes at its receive index in the send
// buffer.
template <typename YT, typename OutT>
__global__ void __launch_bounds__(kThreads) combine_pack_kernel(GpuCombineParams p) {
  const uint32_t epoch = *p.c.state.epoch;
  const Geometry& g = p.c.geo;
  const Layout& l = p.c.layout;
  const int k = g.experts_per_token, lane = lane_id();
  if (host_word(p.c.plan + kPlanDispatchEpoch) != epoch) return;
  int64_t received = host_word(p.c.plan + kPlanReceived);
  received = received < l.shared_slots ? received : l.shared_slots;
  const int64_t nvec = g.hidden_dim / 8;
  constexpr int kW = Vec8<YT>::kWords;
  for (int64_t i = global_warp(); i < received; i += warp_count()) {
    const int n = p.c.state.recv_routes_n[i];
    const char* src = nullptr;
    float w = 0.f;
    if (lane < n) {
      const int32_t row = p.c.state.recv_rows[i * k + lane];
      const RouteEntry e = p.c.state.recv_routes[i * k + lane];
      if (row >= 0) {
        src = p.y + e.local_expert * p.y_s0_bytes + row * p.y_s1_bytes;
        w = e.weight;
      }
    }
    const uint32_t kept = __ballot_sync(0xffffffffu, src != nullptr);
    // Where the row goes: its group's replicas (protocol.h, step 5).
    const int sender = p.c.state.recv_sender[i];
    const int group = sender >= 0 ? g.dp_group_of(sender) : 0;
    const int first = group * g.dp_size;
    const int64_t row =
        sender >= 0 ? i + host_word(p.c.plan + p.c.plan_view.row_shift(group)) : -1;
    const bool row_ok = row >= 0 && row < l.combine_rows;  // always, with a consistent plan
    bool remote = sender < 0;
    for (int q = first; q < first + g.dp_size; ++q) remote |= !l.is_local(q, g.rank);
    char* dst = p.c.send + l.send_combine_offset + i * l.row_bytes;
    for (int64_t v0 = 0; v0 < nvec; v0 += 32) {
      const int64_t v = v0 + lane;
      float acc[8] = {};
      for (uint32_t m = kept; m; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const char* s = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), b));
        const float wb = __shfl_sync(0xffffffffu, w, b);
        if (v < nvec) {
          float f[8];
          Vec8<YT>::load(s + v * 16 * kW, f);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += wb * f[e];
        }
      }
      if (v >= nvec) continue;
      if (remote) Vec8<OutT>::store(dst + v * 16, acc);
      if (row_ok)
        for (int q = first; q < first + g.dp_size; ++q)
          if (l.is_local(q, g.rank))
            Vec8<OutT>::store(p.c.local_bases[l.local_index(q)] + l.local_row_offset(row) + v * 16,
                              acc);
    }
  }
  __threadfence_system();
}

// One warp per token of this rank's group: the rows of the ranks that held
// its routes, summed in fp32 (plus out_tokens when accumulating).
template <typename OutT>
__global__ void __launch_bounds__(kThreads) combine_unpack_kernel(GpuCombineParams p) {
  const uint32_t epoch = *p.c.state.epoch;
  const Geometry& g = p.c.geo;
  const Layout& l = p.c.layout;
  const PlanView& pv = p.c.plan_view;
  const int W = g.world_size, lane = lane_id();
  if (host_word(p.c.plan + kPlanCombineEpoch) != epoch) return;
  const int64_t limit = g.max_num_tokens < p.input_rows ? g.max_num_tokens : p.input_rows;
  bool bad = false;  // reported by the dispatch that read the same bound_m
  const int64_t m = clamp_m(*p.bound_m, limit, &bad);
  const int64_t dm = *p.c.state.dispatch_m;
  const int64_t routed = m < dm ? m : dm;  // tokens past the dispatch's m have no routes
  const int64_t nvec = g.hidden_dim / 8;
  const char* area = p.c.recv + l.combine_offset;
  const char* local_area = p.c.local + l.local_combine_offset;
  for (int64_t t = global_warp(); t < m; t += warp_count()) {
    const int q = g.sender_replica(t);
    // Lanes 0..n-1 end up holding the source rows (at most min(k, W) < 32).
    const char* my_src = nullptr;
    int n = 0;
    for (int r0 = 0; t < routed && r0 < W; r0 += 32) {
      const int r = r0 + lane;
      const char* src = nullptr;
      if (r < W) {
        const int32_t j = p.c.state.dest_index[t * W + r];
        if (j >= 0 && j < host_word(p.c.plan + pv.row_count(q, r))) {
          const int64_t row = host_word(p.c.plan + pv.row_base(q, r)) + j;
          if (row >= 0 && row < l.combine_rows)
            src = (l.is_local(r, g.rank) ? local_area : area) + row * l.row_bytes;
        }
      }
      const uint32_t mask = __ballot_sync(0xffffffffu, src != nullptr);
      const int cnt = __popc(mask);
      const int from = lane >= n && lane < n + cnt ? __fns(mask, 0, lane - n + 1) : lane;
      const char* moved = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), from));
      if (lane >= n && lane < n + cnt) my_src = moved;
      n += cnt;
    }
    char* out = p.out + t * p.out_row_bytes;
    for (int64_t v0 = 0; v0 < nvec; v0 += 32) {
      const int64_t v = v0 + lane;
      float acc[8] = {};
      if (p.accumulate && v < nvec) Vec8<OutT>::load(out + v * 16, acc);
      for (int d = 0; d < n; ++d) {
        const char* s = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_src), d));
        if (v < nvec) {
          const uint4 raw = host_16(s + v * 16);
          float f[8];
          Vec8<OutT>::from_raw(&raw, f);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += f[e];
        }
      }
      if (v < nvec) Vec8<OutT>::store(out + v * 16, acc);
    }
  }
}

}  // namespace

cudaError_t launch_dispatch_pack(const GpuDispatchParams& p, int blocks, cudaStream_t stream) {
  const int W = p.c.geo.world_size;
  next_epoch_kernel<<<1, 1, 0, stream>>>(p.c.state);
  route_scan_kernel<<<W * p.c.geo.dp_size, kThreads, 0, stream>>>(p);
  pack_kernel<<<blocks, kThreads, sizeof(int64_t) * W, stream>>>(p);
  request_kernel<<<1, 1, 0, stream>>>(p.c, 0);
  return cudaGetLastError();
}

cudaError_t launch_dispatch_unpack(const GpuDispatchParams& p, int blocks, cudaStream_t stream) {
  unpack_kernel<<<blocks, kThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  count_kernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_combine_pack(const GpuCombineParams& p, int blocks, cudaStream_t stream) {
  const cudaError_t e = with_combine_types(p.y_dtype, p.out_dtype, [&](auto y, auto out) {
    combine_pack_kernel<typename decltype(y)::type, typename decltype(out)::type>
        <<<blocks, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
  if (e != cudaSuccess) return e;
  request_kernel<<<1, 1, 0, stream>>>(p.c, 1);
  return cudaGetLastError();
}

cudaError_t launch_combine_unpack(const GpuCombineParams& p, int blocks, cudaStream_t stream) {
  if (p.out_dtype == DType::kFloat16)
    combine_unpack_kernel<__half><<<blocks, kThreads, 0, stream>>>(p);
  else
    combine_unpack_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moelink::detail::internode
