#include "fabric/op_state.h"

#include <algorithm>
#include <limits>

namespace moelink::fabric {

void OpState::wait(double timeout_s) const {
  // error_ is written before kDone is set (release): once done() reads
  // true, error_ can be read without a lock.
  if (done()) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  // The worker fails the op at its deadline; wait a little past it.
  auto until = deadline_ + std::chrono::seconds(5);
  if (timeout_s >= 0)
    until = coarse_now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(timeout_s));
  if (!progress_) {
    sleep_until(until);
  } else {
    // Drive progress from this thread, sleeping in short slices once
    // idle, woken early by completion.
    ProgressHook::Waiter waiter(*progress_);
    drive_until([&] { return done(); }, [&](Clock::time_point t) { sleep_until(t); },
                [&] { return until; }, waiter,
                progress_->busy() ? std::numeric_limits<int>::max() : kSpinPolls);
  }
  if (!done())
    throw TimeoutError("TransferEngine " + *what_ + ": not complete within the wait's timeout");
  if (error_) std::rethrow_exception(error_);
}

void OpState::sleep_until(Clock::time_point until) const {
  // One word with finish(): it sees this sleeper, or this sees kDone.
  if (done_sleepers_.fetch_add(1, std::memory_order_acq_rel) & kDone) {
    done_sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_) cv_ = std::make_unique<std::condition_variable>();
    cv_->wait_until(lock, until, [&] { return done(); });
  }
  done_sleepers_.fetch_sub(1, std::memory_order_relaxed);
}

// The callback runs before done() turns true, so a waiter sees its effects.
void OpState::finish() {
  if (has_cb_) {
    // Moved out: what it captured is released once it ran, not when the
    // last reference to the op goes.
    const Callback cb = std::move(cb_);
    try {
      cb(error_);
    } catch (...) {  // a throwing callback must not kill the worker
    }
  }
  if (done_sleepers_.fetch_or(kDone, std::memory_order_acq_rel) != 0) {
    std::condition_variable* cv = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);  // a sleeper is waiting, or about to
      cv = cv_.get();
    }
    if (cv) cv->notify_all();
  }
  if (counters_.done)
    (error_ ? counters_.failed : counters_.done)->fetch_add(1, std::memory_order_release);
}

}  // namespace moelink::fabric
