#include "internode/route_matrix.h"

#include <algorithm>

namespace moelink::detail::internode {

RouteMatrix::RouteMatrix(const Geometry& g, const Layout& l)
    : g_(g),
      l_(l),
      w_(g.world_size),
      c_(static_cast<size_t>(w_) * w_, 0),
      shared_prefix_(static_cast<size_t>(w_) * (w_ + 1), 0),
      recv_prefix_(static_cast<size_t>(w_) * (w_ + 1), 0),
      combine_prefix_(static_cast<size_t>(g.num_dp_groups) * (w_ + 1), 0) {}

void RouteMatrix::set_row(int sender, const uint32_t* counts) {
  std::copy(counts, counts + w_, c_.begin() + static_cast<size_t>(sender) * w_);
}

std::string RouteMatrix::check_receiver(int r) const {
  // A moelink sender sends each of its tokens at most once per rank, and its
  // group's replicas split the group's tokens: the totals below can only be
  // broken by a peer that is not following the protocol.
  int64_t total = 0;
  for (int s = 0; s < w_; ++s) {
    const int64_t c = count(s, r);
    if (c > g_.max_num_tokens)
      return "rank " + std::to_string(s) + " announced " + std::to_string(c) + " tokens for rank " +
             std::to_string(r) +
             ", more than max_num_tokens = " + std::to_string(g_.max_num_tokens);
    total += c;
  }
  if (total > l_.shared_slots)
    return "the ranks announced " + std::to_string(total) + " tokens for rank " +
           std::to_string(r) +
           ", more than num_dp_groups * max_num_tokens = " + std::to_string(l_.shared_slots);
  return {};
}

void RouteMatrix::finish() {
  const int64_t p = l_.private_tokens;
  for (int r = 0; r < w_; ++r) {
    int64_t shared = 0, recv = 0;
    for (int s = 0; s < w_; ++s) {
      shared_prefix_[static_cast<size_t>(r) * (w_ + 1) + s] = shared;
      recv_prefix_[static_cast<size_t>(r) * (w_ + 1) + s] = recv;
      // Node peers' tokens never go through the shared area (protocol.h).
      if (!l_.is_local(s, r)) shared += std::max<int64_t>(0, count(s, r) - p);
      recv += count(s, r);
    }
    shared_prefix_[static_cast<size_t>(r) * (w_ + 1) + w_] = shared;
    recv_prefix_[static_cast<size_t>(r) * (w_ + 1) + w_] = recv;
  }
  for (int g = 0; g < g_.num_dp_groups; ++g) {
    int64_t rows = 0;
    for (int r = 0; r <= w_; ++r) {
      combine_prefix_[static_cast<size_t>(g) * (w_ + 1) + r] = rows;
      if (r < w_) rows += group_rows(g, r);
    }
  }
}

int64_t RouteMatrix::shared_base(int s, int r) const { return at(shared_prefix_, r, s); }
int64_t RouteMatrix::recv_base(int s, int r) const { return at(recv_prefix_, r, s); }
int64_t RouteMatrix::group_rows(int g, int r) const {
  return recv_base((g + 1) * g_.dp_size, r) - recv_base(g * g_.dp_size, r);
}
int64_t RouteMatrix::combine_base(int g, int r) const { return at(combine_prefix_, g, r); }

}  // namespace moelink::detail::internode
