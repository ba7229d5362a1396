// Immediate counters: how many times each 32-bit immediate has arrived.
// Workers add; user threads wait until a count is reached and consume it.
//
// Every arrival and every wait touches a counter, so counters are atomics
// found without a lock: an open-addressing table of (immediate, count)
// slots that only grows (an immediate's slot, once made, stays), read
// lock-free and written under the mutex only when a new immediate shows up.
// Past kSlots * 3/4 distinct immediates, new ones go to a map under the
// mutex (node-based: its counters never move either).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fabric/op_state.h"  // ProgressHook

namespace moelink::fabric {

class ImmCounters {
 public:
  ImmCounters();
  // Adds (immediate, count) pairs: one poll's arrivals, one wake-up.
  void add(const std::vector<std::pair<uint32_t, uint64_t>>& counts);
  // Waits until count(imm) >= count, then subtracts count. Throws
  // TimeoutError naming imm, the count wanted and the count seen.
  // With `progress` (the engine's), the waiter runs progress passes itself
  // until kSpinPolls passes and kSpinWindow went by without work
  // (drive_until), then one after every short sleep (never sleeping when
  // the engine busy-polls), as a ProgressHook::Waiter.
  // A wait that finds the arrivals there touches no shared word.
  void wait(uint32_t imm, uint64_t count, double timeout_s, ProgressHook* progress = nullptr);
  uint64_t get(uint32_t imm) const;
  // Stores value into *flag once count(imm) >= count, consuming count
  // (TransferEngine::signal_on_imm): at once if the arrivals are there,
  // else in the add() that completes them.
  void signal(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value);

  static constexpr size_t kSlots = size_t{1} << 14;

 private:
  using Counter = std::atomic<uint64_t>;
  struct Slot {
    std::atomic<uint64_t> key{0};  // immediate + 1; 0: empty
    Counter count{0};
  };
  // The table's counter of imm, lock-free, or null (*empty: the slot a
  // new imm would take, when not null).
  Counter* probe(uint32_t imm, size_t* empty) const;
  // The counter of imm, or null when imm never arrived nor was waited for.
  Counter* find(uint32_t imm) const;
  // The counter of imm, made (under mu_) when it is new.
  Counter& counter(uint32_t imm);
  // Consumes n arrivals if they are there.
  static bool take(Counter& c, uint64_t n);
  // Sleeps on cv_ until take(c, n) succeeds (true) or `until` (false).
  bool sleep_until(Counter& c, uint64_t n, std::chrono::steady_clock::time_point until);
  // Under mu_: fires the signals whose counts are there.
  void fire_signals();

  const std::unique_ptr<Slot[]> slots_;
  mutable std::mutex mu_;
  size_t used_ = 0;                                // slots taken, under mu_
  std::unordered_map<uint32_t, Counter> overflow_;  // under mu_
  std::atomic<bool> overflowed_{false};            // !overflow_.empty()
  std::condition_variable cv_;
  // Threads asleep on cv_ (adders notify only when there are any).
  std::atomic<int> sleepers_{0};
  struct Signal {
    uint32_t imm;
    uint64_t count;
    uint64_t* flag;
    uint64_t value;
  };
  std::vector<Signal> signals_;  // under mu_, in the order asked for
  std::atomic<bool> has_signals_{false};  // !signals_.empty()
};

}  // namespace moelink::fabric
