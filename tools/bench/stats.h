// Per-iteration samples and their summary (p50, p90, mean of this rank, and
// every rank's p50 gathered through the bootstrap).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "moelink/bootstrap.h"

namespace moelink_bench {

// Quantity name (e.g. "dispatch", "nccl_full_combine") -> microseconds per
// iteration. Every rank holds the same names, in the same (sorted) order.
using Samples = std::map<std::string, std::vector<double>>;

struct Stat {
  double p50 = 0, p90 = 0, mean = 0;
  size_t n = 0;
  std::vector<double> rank_p50;  // [world_size]
};

// Linear interpolation between closest ranks (numpy's default).
double percentile(std::vector<double> v, double q);

// Collective: every rank calls it for the same quantities in the same order.
Stat summarize(moelink::Bootstrap& b, const std::vector<double>& us);

}  // namespace moelink_bench
