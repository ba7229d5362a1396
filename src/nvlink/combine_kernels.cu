// Combine over NVLink (protocol: docs/design.md).
//
// combine_send: one warp per staging slot accepted by the dispatch; it sums
// the weighted expert outputs of the token's local routes in fp32, rounds the
// share to out_dtype and writes it to row (this rank, token) on every rank
// of the token's DP group. The last block publishes the epoch to all ranks.
//
// combine_recv: waits for every rank (the one global barrier of a
// dispatch/combine round), then one warp per token adds the shares of the
// distinct ranks that held its routes, in fp32.
#include "nvlink/device_utils.cuh"

namespace moelink::detail {
namespace {

constexpr int kWarps = kThreadsPerBlock / 32;

template <typename YT, typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock) combine_send_kernel(CombineParams p) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  const uint32_t epoch = p.c.state->epoch;
  const int32_t num_valid = p.c.state->num_valid;
  const int k = g.experts_per_token;
  const int64_t warp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t nvec = g.hidden_dim / 8;

  for (int64_t q = warp; q < num_valid; q += num_warps) {
    const int64_t slot_id = p.c.valid_slots[q];
    const int grp = static_cast<int>(slot_id / g.max_num_tokens);
    const int64_t t = slot_id - static_cast<int64_t>(grp) * g.max_num_tokens;
    const char* slot = p.c.local + g.staging_slot_offset(grp, t);
    const uint32_t n_raw = reinterpret_cast<const SlotHeader*>(slot)->num_routes;
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
    const char* my_src = nullptr;
    float my_w = 0.f;
    for (int d = 0; d < kept; ++d) {
      const int from = __fns(kept_mask, 0, d + 1);
      const char* s = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), from));
      const float ww = __shfl_sync(0xffffffffu, w, from);
      if (lane == d) {
        my_src = s;
        my_w = ww;
      }
    }
    // Lane d (< dp_size) holds row (rank, t) on replica d of the token's group.
    char* my_dst = lane < g.dp_size
                       ? p.c.peers[grp * g.dp_size + lane] + g.combine_row_offset(g.rank, t)
                       : nullptr;
    // Warp-uniform trip count: every lane takes part in the shuffles.
    for (int64_t base = 0; base < nvec; base += 32) {
      const int64_t v = base + lane;
      const bool active = v < nvec;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int d = 0; d < kept; ++d) {
        const char* s = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_src), d));
        const float wd = __shfl_sync(0xffffffffu, my_w, d);
        if (active) {
          float f[8];
          Vec8<YT>::load(s + v * 8 * sizeof(YT), f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += wd * f[i];
        }
      }
      for (int d = 0; d < g.dp_size; ++d) {
        char* dst = reinterpret_cast<char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_dst), d));
        if (active) Vec8<OutT>::store(dst + v * 16, acc);
      }
    }
  }

  if (finish_block_is_last(&p.c.state->arrived[2])) {
    for (int r = threadIdx.x; r < g.world_size; r += blockDim.x)
      store_release_sys(reinterpret_cast<uint64_t*>(p.c.peers[r] + g.combine_flags_offset) + g.rank,
                        epoch);
  }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock) combine_recv_kernel(CombineParams p) {
  const Geometry& g = p.c.geo;
  const int lane = lane_id();
  const uint32_t epoch = p.c.state->epoch;
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(p.c.local + g.combine_flags_offset);
  for (int s = threadIdx.x; s < g.world_size; s += blockDim.x)
    wait_flag(p.c, flags, s, Phase::kCombineRecv, [epoch](uint64_t v) { return v == epoch; });
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
  for (int64_t t = warp; t < m; t += num_warps) {
    int dest = -1;
    if (lane < k) {
      const int64_t e = load_expert_id(p.indices.data, p.indices.dtype,
                                       t * p.indices.stride0 + lane * p.indices.stride1);
      if (classify_route(e, g.num_experts) == RouteKind::kValid) dest = g.rank_of_expert(e);
    }
    const uint32_t same = __match_any_sync(0xffffffffu, dest);
    const bool leads = dest >= 0 && (same & lanes_below()) == 0;
    const uint32_t leaders = __ballot_sync(0xffffffffu, leads);
    const int num_src = __popc(leaders);
    const char* row = leads ? p.c.local + g.combine_row_offset(dest, t) : nullptr;
    const char* my_row = nullptr;
    for (int d = 0; d < num_src; ++d) {
      const char* s = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row), __fns(leaders, 0, d + 1)));
      if (lane == d) my_row = s;
    }
    char* out = p.out + t * p.out_row_bytes;
    for (int64_t base = 0; base < nvec; base += 32) {
      const int64_t v = base + lane;
      const bool active = v < nvec;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (active && p.accumulate) Vec8<OutT>::load(out + v * 16, acc);
      for (int d = 0; d < num_src; ++d) {
        const char* s = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_row), d));
        if (active) {
          float f[8];
          Vec8<OutT>::load(s + v * 16, f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
      }
      if (active) Vec8<OutT>::store(out + v * 16, acc);
    }
  }
}

template <typename OutT>
void launch_combine_send_for_out(const CombineParams& p, int blocks, cudaStream_t s) {
  switch (p.y_dtype) {
    case DType::kBFloat16:
      combine_send_kernel<__nv_bfloat16, OutT><<<blocks, kThreadsPerBlock, 0, s>>>(p);
      break;
    case DType::kFloat16:
      combine_send_kernel<__half, OutT><<<blocks, kThreadsPerBlock, 0, s>>>(p);
      break;
    default:
      combine_send_kernel<float, OutT><<<blocks, kThreadsPerBlock, 0, s>>>(p);
      break;
  }
}

}  // namespace

void launch_combine_send(const CombineParams& p, int blocks, cudaStream_t s) {
  if (p.out_dtype == DType::kFloat16)
    launch_combine_send_for_out<__half>(p, blocks, s);
  else
    launch_combine_send_for_out<__nv_bfloat16>(p, blocks, s);
}

void launch_combine_recv(const CombineParams& p, int blocks, cudaStream_t s) {
  if (p.out_dtype == DType::kFloat16)
    combine_recv_kernel<__half><<<blocks, kThreadsPerBlock, 0, s>>>(p);
  else
    combine_recv_kernel<__nv_bfloat16><<<blocks, kThreadsPerBlock, 0, s>>>(p);
}

}  // namespace moelink::detail
