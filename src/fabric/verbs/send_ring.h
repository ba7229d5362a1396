// The posted send work requests of one RC QP, oldest first, each with the
// worker's context and a sequence number (its wr_id's low bits). Chained
// writes are unsignaled except the last, so a completion retires every entry
// up to and including its own: RC completes in order, so a signaled WR's
// completion means all earlier ones on the QP are done too, and an error
// completion means the ones before it succeeded. Slots are counted by
// SendQueueSlots: an unsignaled WR holds its send-queue slot until a later
// completion retires it, which is also when the NIC frees its WQE.
#pragma once

#include <cstdint>
#include <vector>

#include "fabric/transport.h"
#include "fabric/verbs/wr_builder.h"

namespace moelink::fabric::verbs {

class SendRing {
 public:
  explicit SendRing(uint32_t depth);

  uint32_t free() const { return slots_.free(); }
  size_t size() const { return count_; }
  // Takes a slot for ctx and returns its sequence number. The caller checked
  // free() > 0 (InvalidArgument otherwise).
  uint32_t push(WrContext* ctx);
  // Takes back the newest n entries (a doorbell that was rejected) and
  // appends their contexts to out, oldest first.
  void pop_newest(size_t n, std::vector<WrContext*>& out);
  // Retires the entries up to and including the one numbered seq, oldest
  // first: fn(ctx, is_seq) for each. False, and nothing retired, when seq is
  // not in the ring (a late completion of something already retired).
  template <typename Fn>
  bool retire_through(uint32_t seq, Fn&& fn) {
    size_t k = 0;
    for (; k < count_; ++k)
      if (entries_[(head_ + k) % entries_.size()].seq == seq) break;
    if (k == count_) return false;
    for (size_t i = 0; i <= k; ++i) {
      const Entry e = entries_[head_];
      head_ = (head_ + 1) % entries_.size();
      --count_;
      slots_.give_back(1);
      fn(e.ctx, i == k);
    }
    return true;
  }

 private:
  struct Entry {
    WrContext* ctx = nullptr;
    uint32_t seq = 0;
  };
  SendQueueSlots slots_;
  std::vector<Entry> entries_;
  size_t head_ = 0, count_ = 0;
  uint32_t next_seq_ = 0;
};

}  // namespace moelink::fabric::verbs
