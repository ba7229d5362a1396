#include "floor.h"

#include <algorithm>

namespace moelink_bench {

namespace {

// Accumulates one routing set's bytes of one phase. `rows` is [W][W] (row =
// sender), `hbm` the HBM bytes of each rank.
void add_phase(PhaseBytes& pb, const std::vector<int64_t>& rows, int64_t row_bytes,
               const std::vector<double>& hbm_bytes, int W, int rank,
               const std::vector<double>& peer_GBps, const std::vector<double>& hbm_GBps,
               double weight) {
  double total = 0, max_rank = 0, peer_us = 0, hbm_max = 0, hbm_us = 0;
  for (int x = 0; x < W; ++x) {
    double out = 0, in = 0;
    for (int y = 0; y < W; ++y) {
      if (y == x) continue;
      out += static_cast<double>(rows[static_cast<size_t>(x) * W + y]) * row_bytes;
      in += static_cast<double>(rows[static_cast<size_t>(y) * W + x]) * row_bytes;
    }
    total += out;
    max_rank = std::max({max_rank, out, in});
    if (x == rank) pb.nvlink_mine_out += out * weight;
    if (!peer_GBps.empty() && peer_GBps[x] > 0)
      peer_us = std::max(peer_us, std::max(out, in) / (peer_GBps[x] * 1e3));  // GB/s = 1e3 B/us
    hbm_max = std::max(hbm_max, hbm_bytes[x]);
    if (!hbm_GBps.empty() && hbm_GBps[x] > 0)
      hbm_us = std::max(hbm_us, hbm_bytes[x] / (2.0 * hbm_GBps[x] * 1e3));
  }
  pb.nvlink_total += total * weight;
  pb.nvlink_max_rank += max_rank * weight;
  pb.hbm_max_rank += hbm_max * weight;
  pb.peer_floor_us += peer_us * weight;
  pb.hbm_floor_us += hbm_us * weight;
}

// Rows arriving at each rank (column sums, own rows included).
std::vector<double> arriving(const std::vector<int64_t>& rows, int W) {
  std::vector<double> a(W, 0.0);
  for (int s = 0; s < W; ++s)
    for (int r = 0; r < W; ++r) a[r] += static_cast<double>(rows[static_cast<size_t>(s) * W + r]);
  return a;
}

}  // namespace

Floors compute_floors(const Workload& w, int rank, const std::vector<double>& peer_GBps,
                      const std::vector<double>& hbm_GBps) {
  Floors f;
  const double weight = 1.0 / static_cast<double>(w.traffic.size());
  const double rb = static_cast<double>(w.dispatch_row_bytes());
  const double cb = static_cast<double>(w.combine_row_bytes());
  const double y_row = static_cast<double>(w.H) * 2;  // bf16 expert output
  for (const Traffic& tr : w.traffic) {
    std::vector<double> in_d = arriving(tr.dispatch_rows, w.W);
    std::vector<double> in_c = arriving(tr.combine_rows, w.W);
    std::vector<double> hbm_d(w.W), hbm_c(w.W);
    for (int x = 0; x < w.W; ++x) {
      const double routes = static_cast<double>(tr.routes_to_rank[x]);
      hbm_d[x] = in_d[x] * rb + routes * rb;
      hbm_c[x] = routes * y_row + in_c[x] * cb + static_cast<double>(w.T) * cb;
    }
    add_phase(f.dispatch, tr.dispatch_rows, w.dispatch_row_bytes(), hbm_d, w.W, rank, peer_GBps,
              hbm_GBps, weight);
    add_phase(f.combine, tr.combine_rows, w.combine_row_bytes(), hbm_c, w.W, rank, peer_GBps,
              hbm_GBps, weight);
  }
  return f;
}

}  // namespace moelink_bench
