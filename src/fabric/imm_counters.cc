#include "fabric/imm_counters.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>

#include "fabric/op_state.h"
#include "moelink/errors.h"

namespace moelink::fabric {

namespace {
constexpr size_t kMask = ImmCounters::kSlots - 1;
// Fibonacci hashing: immediates that differ in a few bits (a kind and a
// rank) land in different slots.
size_t slot_of(uint32_t imm) { return (uint64_t{imm} * 0x9E3779B97F4A7C15ull) >> 50 & kMask; }
static_assert(ImmCounters::kSlots == size_t{1} << 14, "slot_of keeps 14 bits");
}  // namespace

ImmCounters::ImmCounters() : slots_(std::make_unique<Slot[]>(kSlots)) {}

ImmCounters::Counter* ImmCounters::probe(uint32_t imm, size_t* empty) const {
  const uint64_t key = uint64_t{imm} + 1;
  // Slots are filled in probe order and never emptied: the first empty one
  // ends the search. The table is at most 3/4 full, so one comes.
  for (size_t i = slot_of(imm);; i = (i + 1) & kMask) {
    const uint64_t k = slots_[i].key.load(std::memory_order_acquire);
    if (k == key) return &slots_[i].count;
    if (k == 0) {
      if (empty) *empty = i;
      return nullptr;
    }
  }
}

ImmCounters::Counter* ImmCounters::find(uint32_t imm) const {
  if (Counter* c = probe(imm, nullptr)) return c;
  if (!overflowed_.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = overflow_.find(imm);
  return it == overflow_.end() ? nullptr : const_cast<Counter*>(&it->second);
}

ImmCounters::Counter& ImmCounters::counter(uint32_t imm) {
  if (Counter* c = find(imm)) return *c;
  std::lock_guard<std::mutex> lock(mu_);
  size_t empty = 0;
  if (Counter* c = probe(imm, &empty)) return *c;  // made since find() looked
  if (auto it = overflow_.find(imm); it != overflow_.end()) return it->second;
  if (used_ < kSlots / 4 * 3) {
    ++used_;
    slots_[empty].key.store(uint64_t{imm} + 1, std::memory_order_release);  // its count is 0
    return slots_[empty].count;
  }
  Counter& c = overflow_[imm];
  overflowed_.store(true, std::memory_order_release);
  return c;
}

bool ImmCounters::take(Counter& c, uint64_t n) {
  // seq_cst: the check after a sleeper counted itself (sleep_until) or a
  // signal was queued (signal) must see an add that did not see them.
  uint64_t v = c.load(std::memory_order_seq_cst);
  while (v >= n)
    if (c.compare_exchange_weak(v, v - n, std::memory_order_acq_rel, std::memory_order_acquire))
      return true;
  return false;
}

void ImmCounters::add(const std::vector<std::pair<uint32_t, uint64_t>>& counts) {
  for (const auto& [imm, n] : counts) counter(imm).fetch_add(n, std::memory_order_seq_cst);
  // seq_cst with signal() and sleep_until(): either this add sees the
  // signal (or the sleeper), or that side sees the new count.
  if (has_signals_.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> lock(mu_);
    fire_signals();
  }
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    // Through the mutex: a sleeper between its check and its wait holds
    // it, so the notification cannot fall in between.
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
  }
}

void ImmCounters::signal(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value) {
  counter(imm);  // made before the signal is visible to add()
  std::lock_guard<std::mutex> lock(mu_);
  signals_.push_back(Signal{imm, count, flag, value});
  has_signals_.store(true, std::memory_order_seq_cst);
  fire_signals();
}

void ImmCounters::fire_signals() {
  for (auto it = signals_.begin(); it != signals_.end();) {
    // Not find(), which would take mu_ again; signal() made the counter.
    Counter* c = probe(it->imm, nullptr);
    if (!c) c = &overflow_.at(it->imm);
    if (!take(*c, it->count)) {
      ++it;
      continue;
    }
    std::atomic_ref<uint64_t>(*it->flag).store(it->value, std::memory_order_release);
    // A full fence drains write-combining buffers too (x86 mfence), so a
    // flag in GDRCopy's BAR mapping becomes visible now rather than later.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    it = signals_.erase(it);
  }
  has_signals_.store(!signals_.empty(), std::memory_order_seq_cst);
}

bool ImmCounters::sleep_until(Counter& c, uint64_t n, std::chrono::steady_clock::time_point until) {
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  std::unique_lock<std::mutex> lock(mu_);
  const bool took = cv_.wait_until(lock, until, [&] { return take(c, n); });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  return took;
}

void ImmCounters::wait(uint32_t imm, uint64_t count, double timeout_s, ProgressHook* progress) {
  using Clock = std::chrono::steady_clock;
  Counter& c = counter(imm);
  if (take(c, count)) return;
  // The coarse clock (a few ms behind at most): deadlines of a wait are
  // that much early at worst.
  const auto timeout =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  if (progress) {
    // Drive progress from this thread instead of waiting for the worker to
    // wake. The deadline is set when the loop first asks for it, so a wait
    // over within 63 passes reads no clock (it is that many passes,
    // microseconds, late at worst).
    bool took = false;  // take() consumes: once true, never asked again
    Clock::time_point deadline{};
    ProgressHook::Waiter waiter(*progress);
    if (drive_until([&] { return took || (took = take(c, count)); },
                    [&](Clock::time_point t) { took = sleep_until(c, count, t); },
                    [&] {
                      if (deadline == Clock::time_point{}) deadline = coarse_now() + timeout;
                      return deadline;
                    },
                    waiter, progress->busy() ? std::numeric_limits<int>::max() : kSpinPolls))
      return;
  } else if (sleep_until(c, count, coarse_now() + timeout)) {
    return;
  }
  if (take(c, count)) return;  // arrived at the deadline
  throw TimeoutError("TransferEngine wait_imm: immediate " + std::to_string(imm) + " arrived " +
                     std::to_string(c.load()) + " of " + std::to_string(count) + " times within " +
                     std::to_string(timeout_s) + " s (a peer is missing or failed)");
}

uint64_t ImmCounters::get(uint32_t imm) const {
  const Counter* c = find(imm);
  return c ? c->load(std::memory_order_acquire) : 0;
}

}  // namespace moelink::fabric
