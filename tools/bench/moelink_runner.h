// Times moelink's dispatch and combine on one token count.
#pragma once

#include <vector>

#include "buffers.h"
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

// Creates the AllToAll, checks one dispatch/combine against the host
// (identity experts), runs --warmup iterations, check(), the timed loop,
// check(); with --split the same again calling each half on its own.
// Iteration i uses routing set i % pool. Collective.
MoelinkRun run_moelink(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                       const Workload& w, Buffers& b, const std::vector<float>& expected);

}  // namespace moelink_bench
