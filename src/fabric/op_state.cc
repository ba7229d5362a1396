#include "fabric/op_state.h"

#include <algorithm>
#include <limits>

namespace moelink::fabric {

void OpState::wait(double timeout_s) const {
  // error_ is written before done_ turns true (release): once done() reads
  // true, error_ can be read without the lock.
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
    std::unique_lock<std::mutex> lock(mu_);
    sleeper_cv().wait_until(lock, until, [&] { return done_.load(); });
  } else {
    // Drive progress from this thread: poll while there is work and for
    // kSpinPolls passes without, then sleep in short slices (woken early
    // by completion) with a pass after each: the workers' idle policy.
    // Passes take no lock; the (coarse) clock is read every 64 of them.
    ProgressHook::Waiting waiting(progress_.get());
    const int spin = progress_->busy() ? std::numeric_limits<int>::max() : kSpinPolls;
    for (int idle = 0, pass = 0; !done(); ++pass) {
      if (idle >= spin) {
        const auto now = Clock::now();
        if (now >= until) break;
        std::unique_lock<std::mutex> lock(mu_);
        sleeper_cv().wait_until(lock, std::min<Clock::time_point>(until, now + kIdleSleep),
                       [&] { return done_.load(); });
        if (done_.load()) break;
      } else if (pass % 64 == 63 && coarse_now() >= until) {
        break;
      }
      idle = progress_->run() ? 0 : idle + 1;
    }
  }
  if (!done())
    throw TimeoutError("TransferEngine " + *what_ + ": not complete within the wait's timeout");
  if (error_) std::rethrow_exception(error_);
}

void OpState::complete_one() {
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
}

void OpState::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_ || error_) return;
    error_ = e;
  }
  finish();
}

// The callback runs before done() turns true, so a waiter sees its effects.
void OpState::finish() {
  if (!has_cb_) {  // the common case: one lock
    bool failed = false;
    std::condition_variable* sleeping = nullptr;  // a sleeper made it under mu_
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finishing_) return;
      finishing_ = true;
      failed = static_cast<bool>(error_);
      done_.store(true, std::memory_order_release);
      sleeping = cv_.get();
    }
    if (sleeping) sleeping->notify_all();
    if (counters_.done) (failed ? counters_.failed : counters_.done)->fetch_add(1, std::memory_order_release);
    return;
  }
  Callback cb;
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_) return;
    finishing_ = true;
    cb = std::move(cb_);
    err = error_;
  }
  if (cb) {
    try {
      cb(err);
    } catch (...) {  // a throwing callback must not kill the worker
    }
  }
  std::condition_variable* sleeping = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
    sleeping = cv_.get();
  }
  if (sleeping) sleeping->notify_all();
}

}  // namespace moelink::fabric
