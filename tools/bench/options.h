// Command-line options of moelink-bench (parsed with CLI11 in options.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moelink/types.h"

namespace moelink_bench {

struct BenchOptions {
  int nproc = 0;  // 0: ranks come from the torchrun environment
  std::string backend = "nvlink";
  std::vector<int64_t> tokens{1, 128, 4096};
  int64_t hidden = 7168;
  int experts = 256;
  int topk = 8;
  int scales = 56;
  std::string in_dtype = "fp8";
  std::string out_dtype = "bf16";
  int dp_size = 1;
  int iters = 1000;
  int warmup = 50;
  int pool = 16;
  std::string json_path;
  bool no_nccl = false;
  // Another moelink backend timed in the same run (same inputs, same
  // stream), its quantities prefixed "<name>_": e.g. nvlink beside nvshmem.
  std::string compare_backend;
  bool no_dense = false;  // skip NVSHMEM's dense all-to-all baseline
  std::string fabric_provider;  // internode backends ("" = default)
  int max_private_tokens = -1;
  int node_size = -1;   // internode backends: Options.node_size (-1 = library default)
  int gpu_direct = -1;  // internode: Options.gpu_direct (-1 = by provider)
  int num_blocks = 0;
  std::string machine;
  bool split = false;
  bool graph = false;  // also time CUDA-graph replays of dispatch and combine
  uint64_t seed = 1;
  std::string command_line;  // argv joined, shell-quoted, for the JSON record

  bool gpu() const { return backend != "cpu" && backend != "internode-cpu"; }
  moelink::DType in_type() const;
  moelink::DType out_type() const;
  // Scales only exist for fp8 tokens: the library requires 0 otherwise.
  int effective_scales() const { return in_dtype == "fp8" ? scales : 0; }
};

// Fills `out`. Returns false when the program should exit right away (--help
// or a usage error) with `exit_code`.
bool parse_options(int argc, char** argv, BenchOptions& out, int& exit_code);

}  // namespace moelink_bench
