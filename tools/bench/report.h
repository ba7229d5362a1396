// Results of a run: the stdout table (rank 0) and the JSON record.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bandwidth.h"
#include "floor.h"
#include "options.h"
#include "stats.h"

namespace moelink_bench {

struct TokenResult {
  int64_t tokens = 0;
  std::map<std::string, Stat> stats;  // quantity -> summary (see bench/README.md)
  Floors floors;
  size_t moelink_buffer_bytes = 0;
  int64_t dispatch_row_bytes = 0, combine_row_bytes = 0;
  int64_t expert_capacity = 0;
};

struct RunInfo {
  const BenchOptions* options = nullptr;
  int world_size = 1;
  std::string gpu_name;  // rank 0's GPU; empty for the CPU backend
  int gpu_count = 0;     // visible to rank 0
  int sm_count = 0;
  std::vector<std::string> rank_pci;
  Bandwidth bandwidth;   // empty for the CPU backend
  double empty_kernel_us = 0;  // event-to-event time of an empty kernel (GPU)
  std::string nccl;      // "on", or why the baselines were skipped
  std::string nccl_version;
  std::string dense;     // NVSHMEM dense baseline: "on", or why it was skipped
};

void print_table(std::FILE* f, const RunInfo& info, const std::vector<TokenResult>& results);
nlohmann::json to_json(const RunInfo& info, const std::vector<TokenResult>& results);

// The commit the binary was built from (recorded at build time), else
// $MOELINK_GIT_COMMIT, else "unknown".
std::string git_commit();
bool git_dirty();

}  // namespace moelink_bench
