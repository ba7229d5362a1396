#include <algorithm>
#include <vector>

#include "bandwidth.h"
#include "cuda_check.h"
#include "stats.h"

namespace moelink_bench {

namespace {

constexpr int64_t kBytes = int64_t{256} << 20;
constexpr int kReps = 20;

// Times kReps back-to-back copies (after two untimed ones) and returns the
// median in seconds. Back to back, so once all ranks are running the copies
// of the ranks overlap for the whole measurement.
template <typename Copy>
double median_copy_s(cudaStream_t s, Copy copy) {
  std::vector<cudaEvent_t> ev(kReps + 1);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  copy();
  copy();
  for (int i = 0; i < kReps; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[i], s));
    copy();
  }
  BENCH_CUDA(cudaEventRecord(ev[kReps], s));
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<double> t;
  for (int i = 0; i < kReps; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    t.push_back(ms * 1e-3);
  }
  for (auto e : ev) cudaEventDestroy(e);
  return percentile(t, 0.5);
}

}  // namespace

Bandwidth measure_bandwidth(moelink::Bootstrap& b, Platform& pl, const GpuInfo& gpu) {
  const int W = b.world_size(), rank = b.rank();
  cudaStream_t s = pl.stream();
  Mem src(pl, kBytes), dst(pl, kBytes);
  Bandwidth bw;
  bw.bytes = kBytes;
  bw.reps = kReps;
  double peer = 0;
  if (W > 1) {
    cudaIpcMemHandle_t mine{};
    BENCH_CUDA(cudaIpcGetMemHandle(&mine, dst.get()));
    std::vector<cudaIpcMemHandle_t> all(W);
    b.all_gather(&mine, all.data(), sizeof(mine));
    const int next = (rank + 1) % W;
    void* peer_dst = nullptr;
    BENCH_CUDA(cudaIpcOpenMemHandle(&peer_dst, all[next], cudaIpcMemLazyEnablePeerAccess));
    // cudaMemcpyPeerAsync wants the peer's ordinal in this process; fall back
    // to a unified-address copy when the peer GPU is not visible here.
    int peer_dev = -1;
    if (cudaDeviceGetByPCIBusId(&peer_dev, gpu.rank_pci[next].c_str()) != cudaSuccess) {
      cudaGetLastError();
      peer_dev = -1;
    }
    b.barrier();
    double t = median_copy_s(s, [&] {
      if (peer_dev >= 0)
        BENCH_CUDA(cudaMemcpyPeerAsync(peer_dst, peer_dev, src.get(), gpu.device, kBytes, s));
      else
        BENCH_CUDA(cudaMemcpyAsync(peer_dst, src.get(), kBytes, cudaMemcpyDefault, s));
    });
    peer = kBytes / t / 1e9;
    b.barrier();  // every peer finished writing into `dst` before it goes
    BENCH_CUDA(cudaIpcCloseMemHandle(peer_dst));
  }
  b.barrier();
  double t = median_copy_s(s, [&] {
    BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), kBytes, cudaMemcpyDeviceToDevice, s));
  });
  double hbm = kBytes / t / 1e9;
  bw.peer_GBps.resize(W);
  bw.hbm_GBps.resize(W);
  b.all_gather(&peer, bw.peer_GBps.data(), sizeof(double));
  b.all_gather(&hbm, bw.hbm_GBps.data(), sizeof(double));
  b.barrier();
  return bw;
}

}  // namespace moelink_bench
