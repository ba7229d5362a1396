// Starting the ranks: fork them on this machine (--nproc) or join a
// torchrun-style job. The rank body gets its bootstrap and local rank.
#pragma once

#include <functional>

#include "moelink/bootstrap.h"

namespace moelink_bench {

// Returns the rank's exit code. Exceptions escaping it are reported with the
// rank and turned into exit code 1.
using RankBody = std::function<int(moelink::Bootstrap& bootstrap, int local_rank)>;

// Forks `nproc` children (rank i, local rank i) that rendezvous over TCP on
// 127.0.0.1 at a free port. The parent only waits: it must make no CUDA call
// before fork (a CUDA context does not survive fork). Returns 0 when every
// rank exited 0; when one fails, the others are terminated.
int run_forked(int nproc, const RankBody& body);

// One rank of a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// LOCAL_RANK).
int run_from_env(const RankBody& body);

}  // namespace moelink_bench
