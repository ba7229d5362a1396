// Lower bounds on dispatch and combine time from the bytes the routing
// forces across NVLink and through HBM, at the measured bandwidths. Averaged
// over the routing pool (each iteration uses one set).
#pragma once

#include <vector>

#include "workload.h"

namespace moelink_bench {

struct PhaseBytes {
  // Means over the routing pool.
  double nvlink_total = 0;     // bytes crossing between ranks, all ranks
  double nvlink_max_rank = 0;  // max over ranks of max(bytes out, bytes in)
  double nvlink_mine_out = 0;  // this rank's bytes out
  double hbm_max_rank = 0;     // HBM bytes (read + written) of the busiest rank
  double peer_floor_us = 0;    // max over ranks of max(out, in) / its peer bandwidth
  double hbm_floor_us = 0;
  double floor_us() const { return peer_floor_us > hbm_floor_us ? peer_floor_us : hbm_floor_us; }
};

struct Floors {
  PhaseBytes dispatch, combine;
};

// Bytes over NVLink: dispatch moves one row (token + scales) per (token,
// destination rank); combine one out_dtype row per (token, expert rank,
// replica of the token's group). Rows a rank keeps for itself do not count.
// The peer floor divides each rank's larger direction by its measured peer
// bandwidth (measured with both directions busy) and takes the worst rank.
//
// Bytes through HBM, the least each rank must read and write (L2 ignored):
//   dispatch: read every row arriving for it (local ones included) once and
//             write one row per route into the expert rows;
//   combine:  read one bf16 expert output row per route, read every partial
//             row coming back, write its T out rows.
// A copy moves each byte twice (read + write), so HBM traffic streams at
// twice the measured copy rate.
// Empty bandwidth vectors (CPU backend) give byte counts and zero floors.
Floors compute_floors(const Workload& w, int rank, const std::vector<double>& peer_GBps,
                      const std::vector<double>& hbm_GBps);

}  // namespace moelink_bench
