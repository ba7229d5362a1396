#include "fabric/imm_counters.h"

#include <chrono>
#include <string>

#include "moelink/errors.h"

namespace moelink::fabric {

void ImmCounters::add(uint32_t imm, uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    counts_[imm] += n;
  }
  cv_.notify_all();
}

void ImmCounters::wait(uint32_t imm, uint64_t count, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const bool ok = cv_.wait_until(lock, deadline, [&] { return counts_[imm] >= count; });
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
