#include "nccl_payload.h"

#include <algorithm>

#include "cuda_check.h"

namespace moelink_bench {

namespace {

// Byte offsets of each peer's region in the send and receive buffers of one
// routing set and phase.
struct Plan {
  std::vector<int64_t> send_off, send_bytes, recv_off, recv_bytes;
  int64_t send_total = 0, recv_total = 0;
};

Plan make_plan(const std::vector<int64_t>& rows, int64_t row_bytes, int W, int me) {
  Plan p;
  p.send_off.assign(W, 0);
  p.send_bytes.assign(W, 0);
  p.recv_off.assign(W, 0);
  p.recv_bytes.assign(W, 0);
  for (int r = 0; r < W; ++r) {
    if (r == me) continue;  // local rows do not cross NVLink
    p.send_off[r] = p.send_total;
    p.send_bytes[r] = rows[static_cast<size_t>(me) * W + r] * row_bytes;
    p.send_total += p.send_bytes[r];
    p.recv_off[r] = p.recv_total;
    p.recv_bytes[r] = rows[static_cast<size_t>(r) * W + me] * row_bytes;
    p.recv_total += p.recv_bytes[r];
  }
  return p;
}

void exchange(const Plan& p, const uint8_t* send, uint8_t* recv, ncclComm_t comm,
              cudaStream_t s) {
  BENCH_NCCL(ncclGroupStart());
  for (size_t r = 0; r < p.send_bytes.size(); ++r) {
    if (p.send_bytes[r] > 0)
      BENCH_NCCL(ncclSend(send + p.send_off[r], p.send_bytes[r], ncclUint8, static_cast<int>(r),
                          comm, s));
    if (p.recv_bytes[r] > 0)
      BENCH_NCCL(ncclRecv(recv + p.recv_off[r], p.recv_bytes[r], ncclUint8, static_cast<int>(r),
                          comm, s));
  }
  BENCH_NCCL(ncclGroupEnd());
}

}  // namespace

Samples time_nccl_payload(NcclComm& comm, moelink::Bootstrap& boot, Platform& pl,
                          const BenchOptions& o, const Workload& w) {
  Samples out;
  if (w.W < 2) return out;
  const int me = comm.rank();
  std::vector<Plan> disp, comb;
  int64_t send_max = 1, recv_max = 1;
  for (const Traffic& tr : w.traffic) {
    disp.push_back(make_plan(tr.dispatch_rows, w.dispatch_row_bytes(), w.W, me));
    comb.push_back(make_plan(tr.combine_rows, w.combine_row_bytes(), w.W, me));
    // One pair of buffers, sized for the largest phase, serves both phases.
    send_max = std::max({send_max, disp.back().send_total, comb.back().send_total});
    recv_max = std::max({recv_max, disp.back().recv_total, comb.back().recv_total});
  }
  Mem a(pl, send_max), bm(pl, recv_max);
  auto* send = a.as<uint8_t>();
  auto* recv = bm.as<uint8_t>();
  cudaStream_t s = pl.stream();
  const int pool = static_cast<int>(disp.size());
  for (int i = 0; i < o.warmup; ++i) {
    exchange(disp[i % pool], send, recv, comm.get(), s);
    exchange(comb[i % pool], send, recv, comm.get(), s);
  }
  pl.sync();
  boot.barrier();
  auto timer = pl.make_timer(o.iters, 3);
  for (int i = 0; i < o.iters; ++i) {
    timer->mark(i, 0);
    exchange(disp[i % pool], send, recv, comm.get(), s);
    timer->mark(i, 1);
    exchange(comb[i % pool], send, recv, comm.get(), s);
    timer->mark(i, 2);
  }
  timer->finish();
  auto& d = out["nccl_payload_dispatch"];
  auto& c = out["nccl_payload_combine"];
  for (int i = 0; i < o.iters; ++i) {
    d.push_back(timer->elapsed_us(i, 0, 1));
    c.push_back(timer->elapsed_us(i, 1, 2));
  }
  boot.barrier();
  return out;
}

}  // namespace moelink_bench
