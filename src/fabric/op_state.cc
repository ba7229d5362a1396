#include "fabric/op_state.h"

#include <algorithm>
#include <limits>

namespace moelink::fabric {

void OpState::wait(double timeout_s) const {
  // The worker fails the op at its deadline; wait a little past it.
  auto until = deadline_ + std::chrono::seconds(5);
  if (timeout_s >= 0)
    until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(timeout_s));
  // Drive progress from this thread: poll while there is work and for
  // kSpinPolls passes without, then sleep in short slices (woken early by
  // completion) with a pass after each: the workers' idle policy.
  ProgressHook::Waiting waiting(progress_.get());
  const int spin = progress_ && progress_->busy() ? std::numeric_limits<int>::max() : kSpinPolls;
  if (progress_ && spin == kSpinPolls) {
    for (int idle = 0; idle < kSpinPolls && !done();)
      idle = progress_->run() ? 0 : idle + 1;
  }
  std::unique_lock<std::mutex> lock(mu_);
  // The clock is read before sleeping and every 64 passes, not every pass.
  for (int idle = spin == kSpinPolls ? kSpinPolls : 0, pass = 0;; ++pass) {
    if (done_.load()) break;
    if (!progress_) {
      if (Clock::now() >= until) break;
      cv_.wait_until(lock, until, [&] { return done_.load(); });
      continue;
    }
    if (idle >= spin || pass % 64 == 0) {
      const auto now = Clock::now();
      if (now >= until) break;
      if (idle >= spin)
        cv_.wait_until(lock, std::min<Clock::time_point>(until, now + kIdleSleep),
                       [&] { return done_.load(); });
    }
    if (done_.load()) break;
    lock.unlock();
    idle = progress_->run() ? 0 : idle + 1;
    lock.lock();
  }
  if (!done_.load())
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finishing_) return;
      finishing_ = true;
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace moelink::fabric
