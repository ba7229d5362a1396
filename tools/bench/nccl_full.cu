#include "nccl_full.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "numeric.h"
#include "verify.h"

namespace moelink_bench {

namespace {

constexpr int kMaxRanks = 64;    // a token's destination ranks form a 64-bit mask
constexpr int kMaxTopK = 16;     // the library's limit on k
constexpr int kWarps = 8;        // warps per block of the row kernels
constexpr int kMaxBlocks = 1024;  // grid-stride beyond this

struct Geom {
  int W, D, rank, replica, L, k, E, S;
  int64_t T, H, C;
  int64_t token_bytes;                    // H * in_bytes, a multiple of 16
  int64_t scale_off, meta_off, row_bytes;  // layout of one message row
  bool out_bf16;
};

__device__ __forceinline__ int load_m(const int32_t* bound_m, int64_t T) {
  const int m = *bound_m;
  return m < 0 ? 0 : (m > T ? static_cast<int>(T) : m);
}

__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = s[i];
}

// Exclusive scan of a per-thread predicate over the block; *total gets the
// number of true predicates. blockDim.x is a multiple of 32; every thread calls.
__device__ int block_scan(bool pred, int* total, int* sm /* [33] */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  const unsigned b = __ballot_sync(~0u, pred);
  const int pre = __popc(b & ((1u << lane) - 1));
  if (lane == 0) sm[warp] = __popc(b);
  __syncthreads();
  if (warp == 0) {
    const int v = lane < nw ? sm[lane] : 0;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(~0u, inc, o);
      if (lane >= o) inc += n;
    }
    if (lane < nw) sm[lane] = inc - v;
    if (lane == 31) sm[32] = inc;
  }
  __syncthreads();
  const int r = sm[warp] + pre;
  *total = sm[32];
  __syncthreads();
  return r;
}

// One block. pos[t][r]: place of token t among the tokens of its replica
// (t % D) that go to rank r, in token order, or -1. cnt[r][i]: how many of
// replica i's tokens go to rank r. Token order (a scan, not atomics) lets the
// combine receiver find each partial without token ids on the wire; every
// rank of a DP group computes the same values for all its replicas.
__global__ void count_kernel(const int32_t* idx, const int32_t* bound_m, Geom g, int32_t* pos,
                             int32_t* cnt, int32_t* send_counts) {
  extern __shared__ int run[];  // [W * D] running counts
  __shared__ int sm[33];
  const int m = load_m(bound_m, g.T);
  for (int i = threadIdx.x; i < g.W * g.D; i += blockDim.x) run[i] = 0;
  __syncthreads();
  for (int c0 = 0; c0 < m; c0 += blockDim.x) {
    const int t = c0 + threadIdx.x;
    const bool valid = t < m;
    uint64_t mask = 0;
    if (valid)
      for (int i = 0; i < g.k; ++i) {
        const int e = idx[static_cast<int64_t>(t) * g.k + i];
        if (e >= 0 && e < g.E) mask |= 1ull << (e / g.L);
      }
    const int rep = valid ? t % g.D : -1;
    for (int r = 0; r < g.W; ++r) {
      const bool bit = (mask >> r) & 1;
      int p = -1;
      for (int i = 0; i < g.D; ++i) {
        const int key = r * g.D + i;
        const int base = run[key];
        const bool pred = bit && rep == i;
        int total;
        const int ex = block_scan(pred, &total, sm);
        if (pred) p = base + ex;
        if (threadIdx.x == 0) run[key] = base + total;
        __syncthreads();
      }
      if (valid) pos[static_cast<int64_t>(t) * g.W + r] = p;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g.W * g.D; i += blockDim.x) cnt[i] = run[i];
  for (int r = threadIdx.x; r < g.W; r += blockDim.x) send_counts[r] = run[r * g.D + g.replica];
}

// One warp per token this rank sends (t % D == replica): one message row
// (token, scales, the token's k expert ids and weights) per destination rank.
__global__ void pack_kernel(const uint8_t* x, const float* scales, const int32_t* idx,
                            const float* wts, const int32_t* bound_m, const int32_t* pos,
                            const int32_t* send_counts, Geom g, uint8_t* sendbuf) {
  __shared__ int64_t off[kMaxRanks];
  if (threadIdx.x == 0) {
    int64_t o = 0;
    for (int r = 0; r < g.W; ++r) {
      off[r] = o;
      o += send_counts[r];
    }
  }
  __syncthreads();
  const int m = load_m(bound_m, g.T);
  const int lane = threadIdx.x % 32;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < m;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    if (t % g.D != g.replica) continue;
    for (int r = 0; r < g.W; ++r) {
      const int p = pos[t * g.W + r];
      if (p < 0) continue;
      uint8_t* dst = sendbuf + (off[r] + p) * g.row_bytes;
      copy16(dst, x + t * g.token_bytes, g.token_bytes, lane);
      for (int s = lane; s < g.S; s += 32)
        reinterpret_cast<float*>(dst + g.scale_off)[s] = scales[t * g.S + s];
      if (lane < g.k) {
        reinterpret_cast<int32_t*>(dst + g.meta_off)[lane] = idx[t * g.k + lane];
        reinterpret_cast<float*>(dst + g.meta_off + 4 * g.k)[lane] = wts[t * g.k + lane];
      }
    }
  }
}

// One warp per received row: each route to a local expert takes that
// expert's next row (atomic) and gets a copy of the token and its scales.
// route_row remembers the row for the combine.
__global__ void unpack_kernel(const uint8_t* recvbuf, int64_t n, Geom g, int32_t* counters,
                              uint8_t* out_x, float* out_scale, int32_t* route_row) {
  const int lane = threadIdx.x % 32;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; j < n;
       j += static_cast<int64_t>(gridDim.x) * kWarps) {
    const uint8_t* row = recvbuf + j * g.row_bytes;
    const auto* ids = reinterpret_cast<const int32_t*>(row + g.meta_off);
    for (int i = 0; i < g.k; ++i) {
      const int e = ids[i];
      const int local = (e >= 0 && e < g.E && e / g.L == g.rank) ? e - g.rank * g.L : -1;
      int dst = -1;
      if (local >= 0) {
        if (lane == 0) dst = atomicAdd(&counters[local], 1);
        dst = __shfl_sync(~0u, dst, 0);
        if (dst >= g.C) dst = -1;  // cannot happen with distinct experts per token
      }
      if (lane == 0) route_row[j * g.k + i] = dst;
      if (dst < 0) continue;
      const int64_t r = static_cast<int64_t>(local) * g.C + dst;
      copy16(out_x + r * g.token_bytes, row, g.token_bytes, lane);
      for (int s = lane; s < g.S; s += 32)
        out_scale[r * g.S + s] = reinterpret_cast<const float*>(row + g.scale_off)[s];
    }
  }
}

// One warp per received row: sum over its routes to local experts of
// weight * expert output in fp32, rounded once to out_dtype (the partial of
// this token and this expert rank).
__global__ void partial_kernel(const uint8_t* recvbuf, const int32_t* route_row,
                               const uint16_t* y, int64_t n, Geom g, uint16_t* partial) {
  const int lane = threadIdx.x % 32;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; j < n;
       j += static_cast<int64_t>(gridDim.x) * kWarps) {
    const uint8_t* meta = recvbuf + j * g.row_bytes + g.meta_off;
    int64_t src = -1;
    float wt = 0;
    if (lane < g.k) {
      const int rr = route_row[j * g.k + lane];
      if (rr >= 0) {
        const int e = reinterpret_cast<const int32_t*>(meta)[lane];
        src = (static_cast<int64_t>(e - g.rank * g.L) * g.C + rr) * g.H;
        wt = reinterpret_cast<const float*>(meta + 4 * g.k)[lane];
      }
    }
    int64_t srcs[kMaxTopK];
    float ws[kMaxTopK];
#pragma unroll
    for (int i = 0; i < kMaxTopK; ++i) {
      srcs[i] = __shfl_sync(~0u, src, i);
      ws[i] = __shfl_sync(~0u, wt, i);
    }
    for (int64_t h = lane * 8; h < g.H; h += 256) {
      float acc[8] = {};
#pragma unroll
      for (int i = 0; i < kMaxTopK; ++i) {
        if (i >= g.k || srcs[i] < 0) continue;
        const int4 v = *reinterpret_cast<const int4*>(y + srcs[i] + h);
        const auto* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] += ws[i] * bf16_to_float(e[q]);
      }
      int4 o;
      auto* oe = reinterpret_cast<uint16_t*>(&o);
#pragma unroll
      for (int q = 0; q < 8; ++q) oe[q] = float_to_out(acc[q], g.out_bf16);
      *reinterpret_cast<int4*>(partial + j * g.H + h) = o;
    }
  }
}

// One warp per token: fp32 sum of the partials the token's expert ranks sent
// back, found through the dispatch's positions, rounded once into out.
__global__ void combine_recv_kernel(const uint16_t* comb, const int32_t* pos, const int32_t* cnt,
                                    const int32_t* bound_m, Geom g, uint16_t* out) {
  extern __shared__ int64_t base[];  // [W * D]: first row of (rank r, replica i)
  __shared__ int64_t rows[kWarps][kMaxRanks];
  if (threadIdx.x == 0) {
    int64_t o = 0;
    for (int i = 0; i < g.W * g.D; ++i) {
      base[i] = o;
      o += cnt[i];
    }
  }
  __syncthreads();
  const int m = load_m(bound_m, g.T);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + w; t < m;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    for (int r = lane; r < g.W; r += 32) {
      const int p = pos[t * g.W + r];
      rows[w][r] = p < 0 ? -1 : (base[r * g.D + t % g.D] + p) * g.H;
    }
    __syncwarp();
    for (int64_t h = lane * 8; h < g.H; h += 256) {
      float acc[8] = {};
      for (int r = 0; r < g.W; ++r) {
        const int64_t s = rows[w][r];
        if (s < 0) continue;
        const int4 v = *reinterpret_cast<const int4*>(comb + s + h);
        const auto* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] += out_to_float(e[q], g.out_bf16);
      }
      int4 o;
      auto* oe = reinterpret_cast<uint16_t*>(&o);
#pragma unroll
      for (int q = 0; q < 8; ++q) oe[q] = float_to_out(acc[q], g.out_bf16);
      *reinterpret_cast<int4*>(out + t * g.H + h) = o;
    }
    __syncwarp();
  }
}

unsigned row_grid(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kWarps - 1) / kWarps, 1, kMaxBlocks));
}

int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

class FullPath {
 public:
  FullPath(NcclComm& comm, Platform& pl, const Workload& w, Buffers& b)
      : comm_(comm), w_(w), b_(b), s_(pl.stream()) {
    const moelink::Config& c = w.config;
    g_.W = w.W;
    g_.D = w.D;
    g_.rank = c.rank;
    g_.replica = c.rank % w.D;
    g_.L = w.L;
    g_.k = w.k;
    g_.E = c.num_experts;
    g_.S = w.S;
    g_.T = w.T;
    g_.H = w.H;
    g_.C = c.expert_capacity();
    g_.token_bytes = w.H * static_cast<int64_t>(w.in_bytes);
    g_.scale_off = g_.token_bytes;
    g_.meta_off = g_.scale_off + align16(4 * w.S);
    g_.row_bytes = g_.meta_off + align16(8 * w.k);
    g_.out_bf16 = c.out_dtype == moelink::DType::kBFloat16;
    const int W = w.W, me = c.rank;
    // Sized from the routing pool's exact traffic (self rows included: they
    // go through NCCL's local path like any other).
    for (const Traffic& tr : w.traffic) {
      int64_t send = 0, recv = 0, back = 0;
      for (int r = 0; r < W; ++r) {
        send += tr.dispatch_rows[static_cast<size_t>(me) * W + r];
        recv += tr.dispatch_rows[static_cast<size_t>(r) * W + me];
        back += tr.combine_rows[static_cast<size_t>(r) * W + me];
      }
      send_cap_ = std::max(send_cap_, send);
      recv_cap_ = std::max(recv_cap_, recv);
      back_cap_ = std::max(back_cap_, back);
    }
    const size_t ob = w.out_bytes;
    pos_ = Mem(pl, static_cast<size_t>(w.T * W) * 4);
    cnt_ = Mem(pl, static_cast<size_t>(W * w.D) * 4);
    send_counts_ = Mem(pl, W * 4);
    recv_counts_ = Mem(pl, W * 4);
    sendbuf_ = Mem(pl, send_cap_ * g_.row_bytes);
    recvbuf_ = Mem(pl, recv_cap_ * g_.row_bytes);
    route_row_ = Mem(pl, recv_cap_ * w.k * 4);
    partial_ = Mem(pl, recv_cap_ * w.H * ob);
    comb_ = Mem(pl, back_cap_ * w.H * ob);
    BENCH_CUDA(cudaMallocHost(&h_cnt_, static_cast<size_t>(W * w.D) * 4));
    BENCH_CUDA(cudaMallocHost(&h_recv_, W * 4));
    BENCH_CUDA(cudaEventCreateWithFlags(&counts_ready_, cudaEventDisableTiming));
  }
  ~FullPath() {
    cudaStreamSynchronize(s_);
    cudaEventDestroy(counts_ready_);
    cudaFreeHost(h_cnt_);
    cudaFreeHost(h_recv_);
  }

  void dispatch(int p) {
    const RoutingTensors& rt = b_.pool[p];
    const auto* idx = static_cast<const int32_t*>(rt.indices.data);
    const auto* bound = static_cast<const int32_t*>(rt.bound_m.data);
    const int W = g_.W;
    auto* counters = static_cast<int32_t*>(b_.out_expert_num_tokens.data);
    BENCH_CUDA(cudaMemsetAsync(counters, 0, g_.L * 4, s_));
    count_kernel<<<1, 1024, W * g_.D * sizeof(int), s_>>>(idx, bound, g_, pos_.as<int32_t>(),
                                                          cnt_.as<int32_t>(),
                                                          send_counts_.as<int32_t>());
    BENCH_CUDA(cudaGetLastError());
    BENCH_NCCL(ncclGroupStart());
    for (int r = 0; r < W; ++r) {
      BENCH_NCCL(ncclSend(send_counts_.as<int32_t>() + r, 1, ncclInt32, r, comm_.get(), s_));
      BENCH_NCCL(ncclRecv(recv_counts_.as<int32_t>() + r, 1, ncclInt32, r, comm_.get(), s_));
    }
    BENCH_NCCL(ncclGroupEnd());
    BENCH_CUDA(cudaMemcpyAsync(h_cnt_, cnt_.get(), W * g_.D * 4, cudaMemcpyDeviceToHost, s_));
    BENCH_CUDA(cudaMemcpyAsync(h_recv_, recv_counts_.get(), W * 4, cudaMemcpyDeviceToHost, s_));
    BENCH_CUDA(cudaEventRecord(counts_ready_, s_));
    // Packing needs no host value: it runs while the host waits for counts.
    pack_kernel<<<row_grid(g_.T), kWarps * 32, 0, s_>>>(
        static_cast<const uint8_t*>(b_.dp_x.data), static_cast<const float*>(b_.dp_x_scale.data),
        idx, static_cast<const float*>(rt.weights.data), bound, pos_.as<int32_t>(),
        send_counts_.as<int32_t>(), g_, sendbuf_.as<uint8_t>());
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaEventSynchronize(counts_ready_));

    int64_t send_off = 0;
    recv_off_.assign(W + 1, 0);
    for (int r = 0; r < W; ++r) recv_off_[r + 1] = recv_off_[r] + h_recv_[r];
    n_recv_ = recv_off_[W];
    int64_t n_send = 0;
    for (int r = 0; r < W; ++r) n_send += h_cnt_[r * g_.D + g_.replica];
    if (n_recv_ > recv_cap_ || n_send > send_cap_)
      throw std::runtime_error("nccl full path: " + std::to_string(n_send) + " rows to send, " +
                               std::to_string(n_recv_) + " to receive exceed the buffers (" +
                               std::to_string(send_cap_) + ", " + std::to_string(recv_cap_) +
                               ") sized from the routing");
    BENCH_NCCL(ncclGroupStart());
    for (int r = 0; r < W; ++r) {
      const int64_t sc = h_cnt_[r * g_.D + g_.replica], rc = h_recv_[r];
      if (sc > 0)
        BENCH_NCCL(ncclSend(sendbuf_.as<uint8_t>() + send_off * g_.row_bytes, sc * g_.row_bytes,
                            ncclUint8, r, comm_.get(), s_));
      if (rc > 0)
        BENCH_NCCL(ncclRecv(recvbuf_.as<uint8_t>() + recv_off_[r] * g_.row_bytes,
                            rc * g_.row_bytes, ncclUint8, r, comm_.get(), s_));
      send_off += sc;
    }
    BENCH_NCCL(ncclGroupEnd());
    if (n_recv_ > 0) {
      unpack_kernel<<<row_grid(n_recv_), kWarps * 32, 0, s_>>>(
          recvbuf_.as<uint8_t>(), n_recv_, g_, counters,
          static_cast<uint8_t*>(b_.out_expert_x.data), static_cast<float*>(b_.out_expert_x_scale.data),
          route_row_.as<int32_t>());
      BENCH_CUDA(cudaGetLastError());
    }
  }

  // Uses the counts the preceding dispatch brought to the host.
  void combine(int p) {
    const RoutingTensors& rt = b_.pool[p];
    const int W = g_.W, D = g_.D;
    const int64_t rb = g_.H * static_cast<int64_t>(w_.out_bytes);
    if (n_recv_ > 0) {
      partial_kernel<<<row_grid(n_recv_), kWarps * 32, 0, s_>>>(
          recvbuf_.as<uint8_t>(), route_row_.as<int32_t>(),
          static_cast<const uint16_t*>(b_.expert_y.data), n_recv_, g_, partial_.as<uint16_t>());
      BENCH_CUDA(cudaGetLastError());
    }
    // From q (as an expert rank): one row per token of this group routed there.
    std::vector<int64_t> back(W);
    int64_t back_total = 0;
    for (int q = 0; q < W; ++q) {
      for (int i = 0; i < D; ++i) back[q] += h_cnt_[q * D + i];
      back_total += back[q];
    }
    if (back_total > back_cap_)
      throw std::runtime_error("nccl full path: " + std::to_string(back_total) +
                               " combine rows exceed the buffer sized from the routing (" +
                               std::to_string(back_cap_) + ")");
    BENCH_NCCL(ncclGroupStart());
    int64_t back_off = 0;
    for (int q = 0; q < W; ++q) {
      // To q: the partials of every row its DP group sent here, which are
      // contiguous in the receive order (senders g*D .. g*D+D-1).
      const int gq = q / D;
      const int64_t first = recv_off_[gq * D], rows = recv_off_[gq * D + D] - first;
      if (rows > 0)
        BENCH_NCCL(ncclSend(partial_.as<uint8_t>() + first * rb, rows * rb, ncclUint8, q,
                            comm_.get(), s_));
      if (back[q] > 0)
        BENCH_NCCL(ncclRecv(comb_.as<uint8_t>() + back_off * rb, back[q] * rb, ncclUint8, q,
                            comm_.get(), s_));
      back_off += back[q];
    }
    BENCH_NCCL(ncclGroupEnd());
    combine_recv_kernel<<<row_grid(g_.T), kWarps * 32, W * D * sizeof(int64_t), s_>>>(
        comb_.as<uint16_t>(), pos_.as<int32_t>(), cnt_.as<int32_t>(),
        static_cast<const int32_t*>(rt.bound_m.data), g_, static_cast<uint16_t*>(b_.out_tokens.data));
    BENCH_CUDA(cudaGetLastError());
  }

  int64_t received_rows() const { return n_recv_; }

 private:
  NcclComm& comm_;
  const Workload& w_;
  Buffers& b_;
  cudaStream_t s_;
  Geom g_{};
  int64_t send_cap_ = 1, recv_cap_ = 1, back_cap_ = 1;
  Mem pos_, cnt_, send_counts_, recv_counts_, sendbuf_, recvbuf_, route_row_, partial_, comb_;
  int32_t* h_cnt_ = nullptr;
  int32_t* h_recv_ = nullptr;
  cudaEvent_t counts_ready_ = nullptr;
  std::vector<int64_t> recv_off_;
  int64_t n_recv_ = 0;
};

}  // namespace

Samples time_nccl_full(NcclComm& comm, moelink::Bootstrap& boot, Platform& pl,
                       const BenchOptions& o, const Workload& w, Buffers& b,
                       const std::vector<float>& expected) {
  if (w.W > kMaxRanks) throw std::runtime_error("nccl full path supports at most 64 ranks");
  FullPath f(comm, pl, w, b);
  const int rank = boot.rank(), pool = static_cast<int>(b.pool.size());

  // Not a no-op: rows received and expert counts against the routing, then
  // a combine through identity experts against the host.
  f.dispatch(0);
  pl.sync();
  int64_t want_rows = 0;
  for (int s = 0; s < w.W; ++s)
    want_rows += w.traffic[0].dispatch_rows[static_cast<size_t>(s) * w.W + rank];
  if (f.received_rows() != want_rows)
    throw std::runtime_error("nccl full dispatch: rank " + std::to_string(rank) + " received " +
                             std::to_string(f.received_rows()) + " rows, the routing sends " +
                             std::to_string(want_rows));
  std::vector<int32_t> counts(w.L);
  pl.download(counts.data(), b.out_expert_num_tokens.data, counts.size() * 4);
  verify_counts("nccl full dispatch", rank, counts, w.traffic[0].my_expert_counts);
  pl.identity_experts(identity_of(b, w, static_cast<const int32_t*>(b.out_expert_num_tokens.data)));
  f.combine(0);
  std::vector<uint16_t> out(static_cast<size_t>(w.T * w.H));
  pl.download(out.data(), b.out_tokens.data, out.size() * 2);
  verify_combine("nccl full combine", rank, w, out, expected);

  for (int i = 0; i < o.warmup; ++i) {
    f.dispatch(i % pool);
    f.combine(i % pool);
  }
  pl.sync();
  boot.barrier();
  auto timer = pl.make_timer(o.iters, 3);
  for (int i = 0; i < o.iters; ++i) {
    timer->mark(i, 0);
    f.dispatch(i % pool);
    timer->mark(i, 1);
    f.combine(i % pool);
    timer->mark(i, 2);
  }
  timer->finish();
  Samples out_s;
  auto& d = out_s["nccl_full_dispatch"];
  auto& c = out_s["nccl_full_combine"];
  for (int i = 0; i < o.iters; ++i) {
    d.push_back(timer->elapsed_us(i, 0, 1));
    c.push_back(timer->elapsed_us(i, 1, 2));
  }
  boot.barrier();
  return out_s;
}

}  // namespace moelink_bench
