// The state of one operation (the engine's Transfer): how many work requests
// are outstanding, its deadline, its error and callback.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "moelink/transfer_engine.h"

namespace moelink::fabric {

using Clock = std::chrono::steady_clock;

class OpState : public Transfer {
 public:
  // `what` names the operation and peer for error messages.
  OpState(std::string what, int work_requests, Clock::time_point deadline, Callback cb)
      : what_(std::move(what)), remaining_(work_requests), deadline_(deadline), cb_(std::move(cb)) {}

  const std::string& what() const { return what_; }
  Clock::time_point deadline() const { return deadline_; }

  bool done() const override { return done_.load(std::memory_order_acquire); }
  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  void wait(double timeout_s) const override;

  // One work request finished; completes the op at the last one.
  void complete_one();
  // Fails the op (first error wins); later completions are ignored.
  void fail(std::exception_ptr e);

 private:
  void finish();
  const std::string what_;
  std::atomic<int> remaining_;
  const Clock::time_point deadline_;
  Callback cb_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::exception_ptr error_;
  bool finishing_ = false;  // under mu_
  std::atomic<bool> done_{false};
};

}  // namespace moelink::fabric
