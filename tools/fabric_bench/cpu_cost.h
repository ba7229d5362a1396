// The engine's software cost per operation, without scheduling noise: two
// endpoints in one process driven by one thread (no peer process, no
// sleeps), the engine's write + wait_imm + wait against the same writes on
// raw libfabric (RawFabric); then a windowed stream of paged writes, with a
// second thread driving the target. Runs in a forked child (the parent
// never initializes libfabric).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace moelink_fabric_bench {

// {"engine": {...}, "raw": {...}, "engine_minus_raw_us": {...},
// "engine_over_raw": {"stream": ...}} with p50s in us of `post` (the call
// that posts one 8-byte write with an immediate) and `round` (post, the
// target's immediate counted, the local completion), and the us per write
// of a windowed paged-write stream (a second thread drives the target).
nlohmann::ordered_json measure_cpu_cost(const std::string& provider, int iters, int reps);

}  // namespace moelink_fabric_bench
