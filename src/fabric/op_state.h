// The state of one operation (the engine's Transfer): how many work requests
// are outstanding, its deadline, its error and callback.
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "moelink/transfer_engine.h"

namespace moelink::fabric {

using Clock = std::chrono::steady_clock;

// Clock::now() at a few milliseconds' resolution, at about a quarter of
// its cost (CLOCK_MONOTONIC_COARSE, the same clock as steady_clock on
// Linux): enough for deadlines of seconds, taken on every operation.
inline Clock::time_point coarse_now() {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0)
    return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
        std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
#endif
  return Clock::now();
}

// Lets a waiting user thread drive the engine's progress itself (read
// completions) instead of sleeping until the worker wakes it. Cleared when
// the engine is destroyed; operations may outlive it.
class ProgressHook {
 public:
  // `busy`: the engine busy-polls (EngineOptions::yield_when_idle false), so
  // waiters spin instead of sleeping between passes.
  explicit ProgressHook(std::function<bool()> fn, bool busy = false)
      : fn_(std::move(fn)), busy_(busy) {}
  bool busy() const { return busy_; }
  // Threads currently waiting and driving progress; while there are any,
  // idle workers sleep instead of spinning (they would compete for the
  // same cores and the same endpoint lock).
  std::atomic<int>& waiters() { return waiters_; }
  struct Waiting {
    explicit Waiting(ProgressHook* h) : h_(h) {
      if (h_) h_->waiters_.fetch_add(1, std::memory_order_relaxed);
    }
    ~Waiting() {
      if (h_) h_->waiters_.fetch_sub(1, std::memory_order_relaxed);
    }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
    ProgressHook* h_;
  };
  // One non-blocking pass; false when another thread is in one, the engine
  // is gone, or there was nothing to do. A waiter runs this in a tight
  // loop, so it takes no mutex: one compare-and-swap claims the pass.
  bool run() {
    int idle = kIdle;
    if (!state_.compare_exchange_strong(idle, kInPass, std::memory_order_acquire)) return false;
    struct Release {  // also when fn_ throws
      std::atomic<int>& s;
      ~Release() { s.store(kIdle, std::memory_order_release); }
    } release{state_};
    return fn_();
  }
  // Waits for a pass in progress; later passes do nothing.
  void clear() {
    for (int seen = kIdle; !state_.compare_exchange_weak(seen, kCleared, std::memory_order_acq_rel);
         seen = kIdle) {
      if (seen == kCleared) return;
      std::this_thread::yield();
    }
  }

 private:
  static constexpr int kIdle = 0, kInPass = 1, kCleared = 2;
  std::atomic<int> state_{kIdle};
  const std::function<bool()> fn_;
  const bool busy_;
  std::atomic<int> waiters_{0};
};

// Waiters poll this many times (progress passes) before sleeping, then
// sleep at most this long between passes: the workers' idle policy (in
// yield mode; busy-polling engines' waiters never sleep).
inline constexpr int kSpinPolls = 200;
inline constexpr std::chrono::microseconds kIdleSleep{50};

class OpState : public Transfer {
 public:
  // `what` names the operation and peer for error messages: built once per
  // peer or group by the engine and shared, so no operation formats text
  // unless it fails.
  OpState(std::shared_ptr<const std::string> what, int work_requests, Clock::time_point deadline,
          Callback cb, std::shared_ptr<ProgressHook> progress = nullptr)
      : what_(std::move(what)),
        remaining_(work_requests),
        deadline_(deadline),
        counters_(take_counters(cb)),
        cb_(std::move(cb)),
        has_cb_(static_cast<bool>(cb_)),
        progress_(std::move(progress)) {}

  const std::string& what() const { return *what_; }
  Clock::time_point deadline() const { return deadline_; }
  bool has_callback() const { return has_cb_; }

  bool done() const override { return done_.load(std::memory_order_acquire); }
  // error_ is written once, before done_ turns true.
  std::exception_ptr error() const override { return done() ? error_ : nullptr; }
  void wait(double timeout_s) const override;

  // One work request finished; completes the op at the last one.
  // Callers hold a reference: the op outlives the call.
  void complete_one() {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1 && claim()) finish();
  }
  // Fails the op unless it already finished or failed (the first outcome
  // wins; later completions are ignored).
  void fail(std::exception_ptr e) {
    if (!claim()) return;
    error_ = std::move(e);
    finish();
  }

 private:
  // The one thread that finishes the op (success or failure) claims it:
  // one compare-and-swap, no lock on the hot path.
  bool claim() {
    bool expected = false;
    return finishing_.compare_exchange_strong(expected, true, std::memory_order_acq_rel);
  }
  // After claim(): the callback (or counters), done_, and a wake-up for a
  // thread asleep in wait().
  void finish();
  const std::shared_ptr<const std::string> what_;
  std::atomic<int> remaining_;
  const Clock::time_point deadline_;
  // count_completions(): the counters replace the callback (cb is left
  // empty), so no completion needs the worker.
  static CompletionCounters take_counters(Callback& cb) {
    CompletionCounters c;
    if (const auto* t = cb.target<CompletionCounters>()) {
      c = *t;
      cb = nullptr;
    }
    return c;
  }
  const CompletionCounters counters_;
  Callback cb_;
  const bool has_cb_;
  const std::shared_ptr<ProgressHook> progress_;
  // Sleepers in wait(): they sleep under mu_ on cv_, which the first one
  // makes (most operations are never slept on, and constructing and
  // destroying a condition variable per operation shows in the cost per
  // write). finish() takes mu_ only when sleepers_ says there is one.
  mutable std::atomic<int> sleepers_{0};
  mutable std::mutex mu_;
  mutable std::unique_ptr<std::condition_variable> cv_;
  // Sleeps until done or `until`.
  void sleep_until(Clock::time_point until) const;
  std::exception_ptr error_;  // written by the claimer, before done_
  std::atomic<bool> finishing_{false};
  std::atomic<bool> done_{false};
};

}  // namespace moelink::fabric
