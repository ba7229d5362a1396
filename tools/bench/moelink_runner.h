// Times moelink's dispatch and combine on one token count.
#pragma once

#include <string>
#include <vector>

#include "buffers.h"
#include "moelink/all_to_all.h"
#include "moelink/bootstrap.h"
#include "options.h"
#include "platform.h"
#include "stats.h"
#include "workload.h"

namespace moelink_bench {

struct MoelinkRun {
  Samples samples;  // dispatch, combine, roundtrip [, dispatch_send, ...]
  size_t buffer_bytes = 0;
};

// "nvlink", "nvshmem", "internode", "cpu" or "internode-cpu" as a
// moelink::Backend.
moelink::Backend backend_of(const std::string& name);

// Creates the AllToAll of `backend`, checks one dispatch/combine against the
// host (identity experts), runs --warmup iterations, check(), the timed
// loop, check(); with --split the same again calling each half on its own;
// with --graph from CUDA graphs. For the proxy
// backends, the phases (<name>_pack, _post, _wire, _unpack) from a second,
// profiled AllToAll.
// Iteration i uses routing set i % pool. Quantity names get `prefix` (empty
// for the backend under test, "nvlink_" for a --compare backend).
// Collective.
MoelinkRun run_moelink(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                       const Workload& w, Buffers& b, const std::vector<float>& expected,
                       moelink::Backend backend, const std::string& prefix = "");

}  // namespace moelink_bench
