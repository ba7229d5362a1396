// The state of one operation (the engine's Transfer): how many work requests
// are outstanding, its deadline, its error and callback.
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>

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

// A spin-wait hint to the core (lets the other hyperthread run, and keeps a
// spinning thread from hammering a cache line another thread holds).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// What one progress pass found.
enum class Pass {
  kWork,  // completions read or work posted
  kIdle,  // nothing to do
  kBusy,  // another thread holds the endpoints (its pass does the work)
};

// Lets a waiting user thread drive the engine's progress itself (read
// completions) instead of sleeping until the worker wakes it. Cleared when
// the engine is destroyed; operations may outlive it.
class ProgressHook {
 public:
  // `busy`: the engine busy-polls (EngineOptions::yield_when_idle false), so
  // waiters spin instead of sleeping between passes.
  explicit ProgressHook(std::function<Pass()> fn, bool busy = false)
      : fn_(std::move(fn)), busy_(busy) {}
  bool busy() const { return busy_; }
  // A stable copy of s: the names of the engine's operations (peers',
  // groups') for error messages. Kept here because operations may outlive
  // the engine and hold this hook until they go: an operation points at
  // its name without a reference count of its own.
  const std::string* name(std::string s) {
    std::lock_guard<std::mutex> lock(names_mu_);
    return &names_.emplace_back(std::move(s));
  }
  // Threads waiting for a while (see Waiter); while there are any, idle
  // workers sleep instead of spinning (they would compete for the same
  // cores and the same endpoint lock).
  std::atomic<int>& waiters() { return waiters_; }
  // A waiting thread's part in the engine's progress, for one wait:
  //  * its hold on the passes: one thread runs them at a time (a second
  //    one would only find the endpoints locked), and clear() waits for
  //    the holder. Held from pass to pass, so that a tight wait loop pays
  //    one compare-and-swap per hold rather than one per pass;
  //  * its count in waiters(), taken only at the first pause(): a wait
  //    over within a few dozen passes (a ping-pong hop) touches no shared
  //    counter, and the worker learns of such short waits from the
  //    passes themselves (Worker::progress).
  // The waiters' loop (drive_until) pauses before it sleeps and every 64
  // passes, so that other waiters and clear() get in.
  class Waiter {
   public:
    explicit Waiter(ProgressHook& hook) : hook_(hook) {}
    ~Waiter() {  // also when a pass throws
      release();
      if (counted_) hook_.waiters_.fetch_sub(1, std::memory_order_relaxed);
    }
    Waiter(const Waiter&) = delete;
    Waiter& operator=(const Waiter&) = delete;
    // One non-blocking pass: kBusy when another thread holds the passes,
    // kIdle when the engine is gone.
    Pass pass() {
      if (!held_) {
        int idle = kIdle;
        if (!hook_.state_.compare_exchange_strong(idle, kInPass, std::memory_order_acquire))
          return idle == kCleared ? Pass::kIdle : Pass::kBusy;
        held_ = true;
      }
      return hook_.fn_();
    }
    // Lets go of the passes; from the first call on, counted as waiting.
    void pause() {
      release();
      if (!counted_) hook_.waiters_.fetch_add(1, std::memory_order_relaxed);
      counted_ = true;
    }

   private:
    void release() {
      if (held_) hook_.state_.store(kIdle, std::memory_order_release);
      held_ = false;
    }
    ProgressHook& hook_;
    bool held_ = false;
    bool counted_ = false;
  };
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
  const std::function<Pass()> fn_;
  const bool busy_;
  std::atomic<int> waiters_{0};
  std::mutex names_mu_;
  std::deque<std::string> names_;  // a deque: entries never move
};

// Waiters sleep once both kSpinPolls passes (progress passes) in a row
// and kSpinWindow have gone by without work; then they sleep at most
// kIdleSleep between passes (yield mode; busy-polling engines' waiters
// never sleep). A pass that finds work starts both again. The window is
// what keeps a transfer moving over shm, where every write needs passes on
// both sides (the target's provider copies the page, the source's reads
// the answer): 200 passes there are only ~11 us (an idle pass ~55 ns), so
// waiters slept between pages and a transfer crawled (2.5-9x behind
// NIXL). Two sleep slices long, the window outlasts the peer's slice: a
// peer waking from one still finds this side spinning. On tcp (~0.5 us a
// pass) 200 passes already take about a window. A waiter with nothing
// arriving still sleeps after one window.
inline constexpr int kSpinPolls = 200;
inline constexpr std::chrono::microseconds kSpinWindow{100};
inline constexpr std::chrono::microseconds kIdleSleep{50};

// A waiter's count of idle passes. A pass that found the endpoints busy
// (the worker's or another thread's pass in progress) is not idle: that
// pass is reading completions. Counted as idle only one in kBusyPerIdle,
// so that a waiter neither sleeps kIdleSleep behind a short pass of the
// worker (which, at one in every kHelpedSleep, made wait loops sleep
// often) nor spins forever behind a long callback. Every kBusyPerYield
// busy passes in a row it yields the CPU: the holder may have been
// preempted on this very CPU (a worker pinned beside a busy-polling
// thread), and would otherwise wait for the end of the spinner's time
// slice, milliseconds.
class IdlePasses {
 public:
  static constexpr int kBusyPerIdle = 32;
  static constexpr int kBusyPerYield = 1024;
  void after(Pass p) {
    if (p == Pass::kWork) {
      idle_ = busy_ = 0;
    } else if (p == Pass::kIdle) {
      ++idle_;
    } else {
      cpu_relax();  // before trying the holder's lock again
      if (++busy_ % kBusyPerIdle == 0) ++idle_;
      if (busy_ % kBusyPerYield == 0) std::this_thread::yield();
    }
  }
  int idle() const { return idle_; }

 private:
  int idle_ = 0, busy_ = 0;
};

// The waiters' loop (Transfer::wait, wait_imm): progress passes until
// done(), like the workers' idle policy: once `spin` passes in a row found
// no work and kSpinWindow went by since the last that did, sleep(until) in
// kIdleSleep slices (it returns early when woken), a pass after each. The
// clock is read at the first idle pass after work, on every pass from the
// `spin`th idle one and before each sleep, the coarse clock every 64
// passes; none of them (nor deadline()) before pass 64, so a wait over
// within 63 passes reads no clock (an idle streak from the wait's start is
// timed from pass 64). The waiter pauses at the same points. Returns
// done() at the end. SpinClock: the window's and the sleeps' clock (a
// test's hand-driven one; its time_point is Clock's).
template <class SpinClock = Clock, class Done, class Sleep, class Deadline>
bool drive_until(Done&& done, Sleep&& sleep, Deadline&& deadline, ProgressHook::Waiter& waiter,
                 int spin) {
  static_assert(std::is_same_v<typename SpinClock::time_point, Clock::time_point>);
  IdlePasses idle;
  // The start of the passes without work: the time of the first idle one
  // (from pass 64 on); unset while passes find work.
  Clock::time_point quiet{};
  for (int pass = 0; !done(); ++pass) {
    bool slept = false;
    if (quiet == Clock::time_point{} && idle.idle() > 0 && pass >= 64) quiet = SpinClock::now();
    if (idle.idle() >= spin) {
      const auto now = SpinClock::now();
      if (quiet == Clock::time_point{}) quiet = now;
      if (now - quiet >= kSpinWindow) {
        waiter.pause();
        if (now >= deadline()) break;
        sleep(std::min<Clock::time_point>(deadline(), now + kIdleSleep));
        if (done()) break;
        slept = true;
      }
    }
    if (!slept && pass % 64 == 63) {
      waiter.pause();
      if (coarse_now() >= deadline()) break;
    }
    const Pass p = waiter.pass();
    if (p == Pass::kWork) quiet = Clock::time_point{};
    idle.after(p);
  }
  return done();
}

class OpState : public Transfer {
 public:
  // `what` names the operation and peer for error messages: built once per
  // peer or group by the engine (ProgressHook::name), so no operation
  // formats text unless it fails. It must outlive the op: `progress`
  // holds it, or the caller does.
  OpState(const std::string* what, int work_requests, Clock::time_point deadline, Callback cb,
          std::shared_ptr<ProgressHook> progress = nullptr)
      : what_(what),
        remaining_(work_requests),
        deadline_(deadline),
        counters_(take_counters(cb)),
        cb_(std::move(cb)),
        has_cb_(static_cast<bool>(cb_)),
        progress_(std::move(progress)) {}

  const std::string& what() const { return *what_; }
  Clock::time_point deadline() const { return deadline_; }
  bool has_callback() const { return has_cb_; }

  bool done() const override { return (done_sleepers_.load(std::memory_order_acquire) & kDone) != 0; }
  // error_ is written once, before done() turns true.
  std::exception_ptr error() const override { return done() ? error_ : nullptr; }
  void wait(double timeout_s) const override;

  // One work request finished; completes the op at the last one.
  // Callers hold a reference: the op outlives the call.
  void complete_one() {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
  }
  // Fails the op unless it already finished or failed (the first outcome
  // wins; later completions are ignored).
  void fail(std::exception_ptr e) {
    // Claimed by swapping the outstanding count for kFailed: no later
    // completion then brings it to 0, and at 0 the op is the last
    // completion's to finish.
    int64_t left = remaining_.load(std::memory_order_acquire);
    do {
      if (left <= 0) return;
    } while (!remaining_.compare_exchange_weak(left, kFailed, std::memory_order_acq_rel));
    error_ = std::move(e);
    finish();
  }

 private:
  // Far below any count of work requests: completions after a failure
  // never bring remaining_ back to 0.
  static constexpr int64_t kFailed = INT64_MIN / 2;
  // Once, by the thread that claimed the outcome (the last completion, or
  // fail): the callback (or counters), done, and a wake-up for threads
  // asleep in wait().
  void finish();
  const std::string* const what_;
  // Work requests not complete; the success path's claim is the decrement
  // to 0, failure's the swap to kFailed (one atomic each, no lock).
  std::atomic<int64_t> remaining_;
  const Clock::time_point deadline_;
  // count_completions(): the counters replace the callback (cb is left
  // empty), so no completion needs the worker.
  static CompletionCounters take_counters(Callback& cb) {
    CompletionCounters c;
    if (!cb) return c;  // target() compares type names
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
  // kDone | threads asleep in wait(), in one word: finish() sets kDone and
  // learns whether anyone sleeps in one atomic. Sleepers sleep under mu_
  // on cv_, which the first one makes (most operations are never slept
  // on, and constructing and destroying a condition variable per
  // operation shows in the cost per write); finish() takes mu_ only when
  // there is one.
  static constexpr uint32_t kDone = 1u << 31;
  mutable std::atomic<uint32_t> done_sleepers_{0};
  mutable std::mutex mu_;
  mutable std::unique_ptr<std::condition_variable> cv_;
  // Sleeps until done or `until`.
  void sleep_until(Clock::time_point until) const;
  std::exception_ptr error_;  // written by the claimer, before kDone
};

}  // namespace moelink::fabric
