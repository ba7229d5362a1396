// NCCL baseline 2: dispatch and combine built honestly on NCCL, the way
// NCCL-based expert-parallel code does it:
//   dispatch: count kernel (destinations per token, positions by scan) ->
//             all-to-all of counts (ncclSend/Recv of ints) -> counts copied
//             to the host (the message sizes NCCL needs) while a pack kernel
//             gathers one row per (token, destination rank) with its routes ->
//             grouped send/recv -> unpack kernel scattering rows into the
//             batched expert layout (atomics for row positions).
//   combine:  per received row, weighted sum of its experts' outputs (bf16
//             partial per token and expert rank) -> grouped send/recv back ->
//             kernel summing each token's partials into out.
// Everything between the two events of a phase is timed, host waits included.
#pragma once

#include <vector>

#include "buffers.h"
#include "nccl_comm.h"
#include "options.h"
#include "platform.h"
#include "stats.h"
#include "workload.h"

namespace moelink_bench {

// Verifies once (expert counts, rows received, identity-expert combine
// against the host), then times nccl_full_dispatch and nccl_full_combine.
// Reuses the inputs and expert tensors of `b`. Collective.
Samples time_nccl_full(NcclComm& comm, moelink::Bootstrap& boot, Platform& pl,
                       const BenchOptions& o, const Workload& w, Buffers& b,
                       const std::vector<float>& expected);

}  // namespace moelink_bench
