#include "fabric/verbs/send_ring.h"

#include <string>

#include "moelink/errors.h"

namespace moelink::fabric::verbs {

SendRing::SendRing(uint32_t depth) : slots_(depth), entries_(depth) {
  if (depth == 0) throw InvalidArgument("verbs send ring: depth 0");
}

uint32_t SendRing::push(WrContext* ctx) {
  if (!slots_.try_take(1))
    throw InvalidArgument("verbs send ring: full at " + std::to_string(entries_.size()) +
                          " work requests");
  const uint32_t seq = next_seq_++;
  entries_[(head_ + count_) % entries_.size()] = Entry{ctx, seq};
  ++count_;
  return seq;
}

void SendRing::pop_newest(size_t n, std::vector<WrContext*>& out) {
  if (n > count_)
    throw InvalidArgument("verbs send ring: taking back " + std::to_string(n) + " of " +
                          std::to_string(count_) + " entries");
  const size_t first = out.size();
  out.resize(first + n);
  for (size_t i = 0; i < n; ++i) {
    --count_;
    out[first + n - 1 - i] = entries_[(head_ + count_) % entries_.size()].ctx;
    slots_.give_back(1);
  }
}

}  // namespace moelink::fabric::verbs
