#include "fabric/imm_counters.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>

#include "fabric/op_state.h"
#include "moelink/errors.h"

namespace moelink::fabric {

void ImmCounters::add(const std::vector<std::pair<uint32_t, uint64_t>>& counts) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [imm, n] : counts) counts_[imm] += n;
    if (!signals_.empty()) fire_signals();
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
}

void ImmCounters::signal(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  signals_.push_back(Signal{imm, count, flag, value});
  fire_signals();
}

void ImmCounters::fire_signals() {
  for (auto it = signals_.begin(); it != signals_.end();) {
    uint64_t& c = counts_[it->imm];
    if (c < it->count) {
      ++it;
      continue;
    }
    c -= it->count;
    std::atomic_ref<uint64_t>(*it->flag).store(it->value, std::memory_order_release);
    // A full fence drains write-combining buffers too (x86 mfence), so a
    // flag in GDRCopy's BAR mapping becomes visible now rather than later.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    it = signals_.erase(it);
  }
}

void ImmCounters::wait(uint32_t imm, uint64_t count, double timeout_s,
                       const std::function<bool()>& progress, bool sleep_when_idle) {
  const int spin = sleep_when_idle ? kSpinPolls : std::numeric_limits<int>::max();
  using Clock = std::chrono::steady_clock;
  // The coarse clock (a few ms behind at most): deadlines of a wait are
  // that much early at worst.
  const auto deadline =
      coarse_now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  // Under mu_: consume `count` arrivals if they are there.
  const auto take = [&] {
    uint64_t& c = counts_[imm];
    if (c < count) return false;
    c -= count;
    return true;
  };
  // Read before the first look, so that an arrival after it shows as a new
  // generation.
  uint64_t seen = generation_.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (take()) return;
  }
  if (progress) {
    // Poll like the workers (a short sleep after kSpinPolls passes without
    // work), driving progress from this thread instead of waiting for the
    // worker to wake. The counts are looked at (under mu_) only when some
    // immediate arrived since the last look; the clock is read before
    // sleeping, and the coarse clock every 64 passes.
    for (int idle = 0, pass = 0;; ++pass) {
      if (idle >= spin) {
        const auto now = Clock::now();
        if (now >= deadline) break;
        std::unique_lock<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        if (cv_.wait_until(lock, std::min(deadline, now + kIdleSleep),
                           [&] { return counts_[imm] >= count; })) {
          counts_[imm] -= count;
          return;
        }
      } else if (pass % 64 == 63 && coarse_now() >= deadline) {
        break;
      }
      idle = progress() ? 0 : idle + 1;
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g != seen) {
        seen = g;
        std::lock_guard<std::mutex> lock(mu_);
        if (take()) return;
      }
    }
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_until(lock, deadline, [&] { return counts_[imm] >= count; })) {
      counts_[imm] -= count;
      return;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (take()) return;  // arrived at the deadline
  throw TimeoutError("TransferEngine wait_imm: immediate " + std::to_string(imm) + " arrived " +
                     std::to_string(counts_[imm]) + " of " + std::to_string(count) +
                     " times within " + std::to_string(timeout_s) +
                     " s (a peer is missing or failed)");
}

uint64_t ImmCounters::get(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(imm);
  return it == counts_.end() ? 0 : it->second;
}

}  // namespace moelink::fabric
