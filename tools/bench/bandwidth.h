// The copy bandwidths the floors are computed from, measured on this very
// machine rather than taken from a data sheet.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu_info.h"
#include "moelink/bootstrap.h"
#include "platform.h"

namespace moelink_bench {

struct Bandwidth {
  int64_t bytes = 0;  // per copy
  int reps = 0;
  // Per rank, GB/s (1e9 bytes/s), median over reps. peer: this rank's GPU
  // copying into the next rank's buffer while every rank does the same (so
  // each GPU sends and receives at once, as in an all-to-all); 0 with one
  // rank. hbm: device-to-device cudaMemcpy on the rank's own GPU (bytes
  // copied per second; the memory moves twice that).
  std::vector<double> peer_GBps, hbm_GBps;
};

// Collective. The peer buffer is shared with CUDA IPC, as ranks are processes.
Bandwidth measure_bandwidth(moelink::Bootstrap& b, Platform& pl, const GpuInfo& gpu);

}  // namespace moelink_bench
