// Immediate counters: how many times each 32-bit immediate has arrived.
// Workers add; user threads wait until a count is reached and consume it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moelink::fabric {

class ImmCounters {
 public:
  // Adds (immediate, count) pairs: one poll's arrivals under one lock, one
  // wake-up.
  void add(const std::vector<std::pair<uint32_t, uint64_t>>& counts);
  // Waits until count(imm) >= count, then subtracts count. Throws
  // TimeoutError naming imm, the count wanted and the count seen.
  // With `progress`, the waiter calls it (one non-blocking progress pass)
  // kSpinPolls times before sleeping, then after every short sleep.
  // `sleep_when_idle` false (a busy-polling engine): never sleep.
  void wait(uint32_t imm, uint64_t count, double timeout_s,
            const std::function<bool()>& progress = {}, bool sleep_when_idle = true);
  uint64_t get(uint32_t imm) const;
  // Stores value into *flag once count(imm) >= count, consuming count
  // (TransferEngine::signal_on_imm): at once if the arrivals are there,
  // else in the add() that completes them.
  void signal(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint32_t, uint64_t> counts_;
  // Bumped by every add: a polling waiter looks at counts_ only when it moved.
  std::atomic<uint64_t> generation_{0};
  struct Signal {
    uint32_t imm;
    uint64_t count;
    uint64_t* flag;
    uint64_t value;
  };
  std::vector<Signal> signals_;  // under mu_, in the order asked for
  // Under mu_: fires the signals whose counts are there.
  void fire_signals();
};

}  // namespace moelink::fabric
