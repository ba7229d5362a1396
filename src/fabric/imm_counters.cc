#include "fabric/imm_counters.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "fabric/op_state.h"
#include "moelink/errors.h"

namespace moelink::fabric {

void ImmCounters::add(uint32_t imm, uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    counts_[imm] += n;
  }
  cv_.notify_all();
}

void ImmCounters::wait(uint32_t imm, uint64_t count, double timeout_s,
                       const std::function<bool()>& progress) {
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(mu_);
  bool ok = counts_[imm] >= count;
  if (!ok && progress) {
    // Poll like the workers (a short sleep after kSpinPolls passes without
    // work), driving progress from this thread instead of waiting for the
    // worker to wake.
    // The clock is read before sleeping and every 64 passes, not every pass.
    for (int idle = 0, pass = 0; !ok; ++pass) {
      if (idle >= kSpinPolls || pass % 64 == 0) {
        const auto now = Clock::now();
        if (now >= deadline) break;
        if (idle >= kSpinPolls)
          ok = cv_.wait_until(lock, std::min(deadline, now + kIdleSleep),
                              [&] { return counts_[imm] >= count; });
      }
      if (ok) break;
      lock.unlock();
      idle = progress() ? 0 : idle + 1;
      lock.lock();
      ok = counts_[imm] >= count;
    }
  } else if (!ok) {
    ok = cv_.wait_until(lock, deadline, [&] { return counts_[imm] >= count; });
  }
  if (!ok)
    throw TimeoutError("TransferEngine wait_imm: immediate " + std::to_string(imm) +
                       " arrived " + std::to_string(counts_[imm]) + " of " +
                       std::to_string(count) + " times within " + std::to_string(timeout_s) +
                       " s (a peer is missing or failed)");
  counts_[imm] -= count;
}

uint64_t ImmCounters::get(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(imm);
  return it == counts_.end() ? 0 : it->second;
}

}  // namespace moelink::fabric
