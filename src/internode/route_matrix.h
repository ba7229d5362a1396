// The routing matrix of one epoch: C[s][r] = tokens sender s sends to rank r,
// assembled from every peer's RouteHeader, and the prefix sums the protocol
// needs (protocol.h, steps 3-6). Host only; rebuilt every epoch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.h"
#include "internode/protocol.h"

namespace moelink::detail::internode {

class RouteMatrix {
 public:
  RouteMatrix(const Geometry& g, const Layout& l);

  void set_row(int sender, const uint32_t* counts);
  uint32_t count(int sender, int receiver) const {
    return c_[static_cast<size_t>(sender) * w_ + receiver];
  }
  // Checks what this rank will receive against its buffers. Returns "" or
  // a description naming the sender whose counts do not fit.
  std::string check_receiver(int receiver) const;
  // Recomputes the prefix sums below from the rows set.
  void finish();

  // Sender s's offset (in slots) in receiver r's shared area.
  int64_t shared_base(int sender, int receiver) const;
  // Slots received by r from senders before s: s's first receive index.
  int64_t recv_base(int sender, int receiver) const;
  // Tokens of group g that rank r received: N[g][r].
  int64_t group_rows(int group, int receiver) const;
  // Row of r's block in a replica of group g's combine area.
  int64_t combine_base(int group, int receiver) const;
  // Total slots rank r receives.
  int64_t received(int receiver) const { return recv_base(w_, receiver); }

 private:
  int64_t at(const std::vector<int64_t>& v, int i, int j) const {
    return v[static_cast<size_t>(i) * (w_ + 1) + j];
  }
  Geometry g_;
  Layout l_;
  int w_;
  std::vector<uint32_t> c_;              // [W][W]
  std::vector<int64_t> shared_prefix_;   // [r][s]: sum_{s' < s, s' remote} max(0, C[s'][r] - P)
  std::vector<int64_t> recv_prefix_;     // [r][s]: sum_{s' < s} C[s'][r], s <= W
  std::vector<int64_t> combine_prefix_;  // [g][r]: sum_{r' < r} N[g][r'], r <= W
};

}  // namespace moelink::detail::internode
