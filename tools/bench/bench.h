// The body of one rank: set up the platform (and on GPUs the bandwidth
// measurement and the NCCL communicator), then for each token count build the
// workload, time moelink and the baselines, and summarize; rank 0 prints the
// table and writes the JSON.
#pragma once

#include "moelink/bootstrap.h"
#include "options.h"

namespace moelink_bench {

int run_rank(const BenchOptions& o, moelink::Bootstrap& boot, int local_rank);

}  // namespace moelink_bench
