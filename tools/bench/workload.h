// The host-side workload of one token count: this rank's tokens and scales,
// a pool of routing sets, and for every routing set the traffic it implies
// between all ranks (which sizes the NCCL baselines and the floors) and the
// expert counts this rank must receive (which checks both implementations).
#pragma once

#include <cstdint>
#include <vector>

#include "moelink/config.h"
#include "options.h"

namespace moelink_bench {

struct RoutingSet {
  std::vector<int32_t> indices;  // [T, k] distinct experts per token
  std::vector<float> weights;    // [T, k] positive, summing to 1 per token
};

// Rows (one per token and destination rank, as moelink moves them) of one
// routing set. Matrices are [W][W], row = sender.
struct Traffic {
  std::vector<int64_t> dispatch_rows;  // token rows s -> r (r != s: over NVLink)
  std::vector<int64_t> combine_rows;   // partial rows r -> q (the D replicas of a group each get one)
  std::vector<int64_t> routes_to_rank;  // [W] routes landing on rank r's experts
  std::vector<int32_t> my_expert_counts;  // [L] rows this rank's experts receive
};

struct Workload {
  moelink::Config config;
  int64_t T = 0, H = 0;
  int S = 0, k = 0, W = 0, D = 0, L = 0;
  size_t in_bytes = 0, out_bytes = 0;
  std::vector<uint8_t> x;     // [T, H] in_dtype bytes of this rank's DP group
  std::vector<float> scales;  // [T, S]
  std::vector<RoutingSet> pool;   // this rank's DP group
  std::vector<Traffic> traffic;   // per pool entry

  // Bytes of one dispatched row (token + scales) and one combined row, as
  // counted by the NCCL payload baseline and the floor.
  int64_t dispatch_row_bytes() const { return H * static_cast<int64_t>(in_bytes) + S * 4; }
  int64_t combine_row_bytes() const { return H * static_cast<int64_t>(out_bytes); }
};

// Deterministic in (seed, T, DP group, pool entry): the replicas of a DP group
// build identical inputs, and every rank can rebuild every group's routing to
// count the traffic without communicating.
Workload make_workload(const BenchOptions& o, const moelink::Config& c);

// out[t] of a combine after identity experts (y = x * scale, rounded to
// bf16) with routing set `p`, the way moelink defines it: one out_dtype
// partial per (token, expert rank), summed in fp32. [T, H] floats.
std::vector<float> expected_combine(const Workload& w, int p);

}  // namespace moelink_bench
