#include "nvshmem_dense.h"

#include <algorithm>

#if defined(MOELINK_BENCH_NVSHMEM)
#include "nvshmem/runtime.h"
#endif

namespace moelink_bench {

std::string nvshmem_dense_unavailable(const BenchOptions& o, bool ranks_share_gpu) {
#if defined(MOELINK_BENCH_NVSHMEM)
  if (o.no_dense) return "off (--no-dense)";
  if (o.backend != "nvshmem" && o.compare_backend != "nvshmem")
    return "off (runs when nvshmem is timed)";
  // NVSHMEM's collectives exit the process in its limited multiple-PEs-per-GPU mode.
  if (ranks_share_gpu) return "off (ranks share a GPU; NVSHMEM collectives need one GPU per PE)";
  return "";
#else
  (void)o;
  (void)ranks_share_gpu;
  return "off (this build has no NVSHMEM)";
#endif
}

Samples time_nvshmem_dense(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                           const Workload& w) {
  Samples out;
#if defined(MOELINK_BENCH_NVSHMEM)
  namespace shmem = moelink::detail::shmem;
  shmem::ensure_initialized(boot);
  const size_t disp = static_cast<size_t>(w.T * w.dispatch_row_bytes());
  const size_t comb = static_cast<size_t>(w.T * w.combine_row_bytes());
  const size_t block = std::max(disp, comb);
  // One symmetric buffer: W source blocks, then W destination blocks.
  const size_t half = block * static_cast<size_t>(w.W);
  char* buf = shmem::symmetric_acquire(2 * half, boot);
  char* src = buf;
  char* dst = buf + half;
  cudaStream_t s = pl.stream();
  for (int i = 0; i < o.warmup; ++i) {
    shmem::dense_alltoall(dst, src, disp, s);
    shmem::dense_alltoall(dst, src, comb, s);
  }
  pl.sync();
  boot.barrier();
  auto timer = pl.make_timer(o.iters, 3);
  for (int i = 0; i < o.iters; ++i) {
    timer->mark(i, 0);
    shmem::dense_alltoall(dst, src, disp, s);
    timer->mark(i, 1);
    shmem::dense_alltoall(dst, src, comb, s);
    timer->mark(i, 2);
  }
  timer->finish();
  auto& d = out["nvshmem_dense_dispatch"];
  auto& c = out["nvshmem_dense_combine"];
  for (int i = 0; i < o.iters; ++i) {
    d.push_back(timer->elapsed_us(i, 0, 1));
    c.push_back(timer->elapsed_us(i, 1, 2));
  }
  pl.sync();
  shmem::symmetric_release(buf);
  boot.barrier();
#else
  (void)boot;
  (void)pl;
  (void)o;
  (void)w;
#endif
  return out;
}

}  // namespace moelink_bench
