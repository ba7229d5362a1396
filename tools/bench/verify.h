// Correctness checks run once per token count before timing, for moelink and
// for the NCCL full path alike: a benchmark of something that moves the
// wrong bytes (or none) must fail instead of reporting a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "workload.h"

namespace moelink_bench {

// Rows each local expert received against the count the routing implies.
void verify_counts(const std::string& who, int rank, const std::vector<int32_t>& got,
                   const std::vector<int32_t>& want);

// Combined tokens ([T, H] out_dtype bits) after identity experts against
// expected_combine(): within a few out_dtype ulps (partials are rounded once
// per expert rank, and summation order differs between implementations).
void verify_combine(const std::string& who, int rank, const Workload& w,
                    const std::vector<uint16_t>& got, const std::vector<float>& expected);

}  // namespace moelink_bench
