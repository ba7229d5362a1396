// NVSHMEM baseline: NVSHMEM's own dense all-to-all (nvshmemx_alltoallmem_on_stream)
// moving worst-case-padded buffers, as a dense EP layer without routing
// information would: dispatch sends every rank T rows of token + scales
// (any of its tokens might go there), combine sends every rank T rows of
// out_dtype back. The sizes depend only on the shape, never on the routing.
// Timing only: no packing, no unpacking, nothing to verify.
#pragma once

#include <string>

#include "moelink/bootstrap.h"
#include "options.h"
#include "platform.h"
#include "stats.h"
#include "workload.h"

namespace moelink_bench {

// Empty when the baseline can run in this build and run, else why not.
std::string nvshmem_dense_unavailable(const BenchOptions& o, bool ranks_share_gpu);

// nvshmem_dense_dispatch, nvshmem_dense_combine. Starts NVSHMEM if no
// AllToAll did yet. Collective.
Samples time_nvshmem_dense(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                           const Workload& w);

}  // namespace moelink_bench
