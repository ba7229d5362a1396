// NCCL baseline 1: only the payload. Grouped ncclSend/ncclRecv moving, per
// pair of ranks, exactly the bytes moelink's dispatch moves over NVLink for
// the routing set (one row of token + scales per token and destination rank),
// then the combine direction (one out_dtype row per token, expert rank and
// replica). Sizes are known on the host: no count exchange, no packing.
#pragma once

#include "nccl_comm.h"
#include "options.h"
#include "platform.h"
#include "stats.h"
#include "workload.h"

namespace moelink_bench {

// nccl_payload_dispatch, nccl_payload_combine. Empty with one rank (nothing
// crosses between ranks). Collective.
Samples time_nccl_payload(NcclComm& comm, moelink::Bootstrap& boot, Platform& pl,
                          const BenchOptions& o, const Workload& w);

}  // namespace moelink_bench
