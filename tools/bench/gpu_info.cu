#include <cstring>
#include <set>

#include "cuda_check.h"
#include "gpu_info.h"

namespace moelink_bench {

bool GpuInfo::distinct() const {
  return std::set<std::string>(rank_pci.begin(), rank_pci.end()).size() == rank_pci.size();
}

GpuInfo select_gpu(moelink::Bootstrap& b, int local_rank) {
  GpuInfo g;
  BENCH_CUDA(cudaGetDeviceCount(&g.count));
  if (g.count < 1) throw std::runtime_error("no CUDA device visible");
  g.device = local_rank % g.count;
  BENCH_CUDA(cudaSetDevice(g.device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, g.device));
  g.name = prop.name;
  g.sm_count = prop.multiProcessorCount;
  char pci[64] = {};
  BENCH_CUDA(cudaDeviceGetPCIBusId(pci, sizeof(pci) - 1, g.device));
  std::vector<char> all(sizeof(pci) * b.world_size());
  b.all_gather(pci, all.data(), sizeof(pci));
  for (int r = 0; r < b.world_size(); ++r)
    g.rank_pci.emplace_back(&all[r * sizeof(pci)], strnlen(&all[r * sizeof(pci)], sizeof(pci)));
  return g;
}

}  // namespace moelink_bench
