// Which GPU a rank uses and what it is, gathered over all ranks.
#pragma once

#include <string>
#include <vector>

#include "moelink/bootstrap.h"

namespace moelink_bench {

struct GpuInfo {
  int device = -1;      // ordinal used by this rank: local_rank % device_count
  int count = 0;        // devices visible to this rank
  std::string name;     // this rank's GPU
  int sm_count = 0;
  std::vector<std::string> rank_pci;  // [world_size] PCI bus id of every rank's GPU
  // True when no two ranks share a GPU (NCCL refuses duplicate GPUs).
  bool distinct() const;
};

// Selects the device (cudaSetDevice) and gathers the PCI ids. Collective.
GpuInfo select_gpu(moelink::Bootstrap& b, int local_rank);

}  // namespace moelink_bench
