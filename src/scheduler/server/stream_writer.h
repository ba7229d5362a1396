// A server-streaming gRPC call (callback API) as a Sink: messages queue and
// go out one write at a time; close() ends the stream after them.
//
// gRPC may run the reactor's callbacks inline, inside StartWrite or Finish,
// so no lock is held across those calls, and the on_end callback (how the
// core learns that a stream ended) must only queue a notification.
#pragma once
#include <grpcpp/support/server_callback.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "scheduler/core/sink.h"

namespace moelink::scheduler {

template <class Msg>
class StreamWriter final : public grpc::ServerWriteReactor<Msg>, public Sink<Msg> {
 public:
  // The writer keeps itself alive until gRPC is done with it (OnDone).
  static std::shared_ptr<StreamWriter> create() {
    std::shared_ptr<StreamWriter> w(new StreamWriter());
    w->self_ = w;
    return w;
  }

  // Runs (once, on a gRPC thread) when the stream ends for any reason:
  // cancelled by the peer, or finished. `cancelled` tells which.
  void set_on_end(std::function<void(bool cancelled)> f) { on_end_ = std::move(f); }

  bool send(Msg msg) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_) return false;
    if (writing_) {
      queue_.push_back(std::move(msg));
      return true;
    }
    writing_ = true;
    current_ = std::move(msg);
    lock.unlock();
    this->StartWrite(&current_);
    return true;
  }

  void close(const grpc::Status& status) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_) return;
    closing_ = true;
    status_ = status;
    if (writing_) return;  // OnWriteDone finishes after the queue drains
    finish_locked(lock);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ok) {  // the peer is gone: drop the rest
      queue_.clear();
      if (!closing_) {
        closing_ = true;
        status_ = grpc::Status(grpc::StatusCode::CANCELLED, "stream broken");
      }
    }
    if (!queue_.empty()) {
      current_ = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      this->StartWrite(&current_);
      return;
    }
    writing_ = false;
    if (closing_) finish_locked(lock);
  }

  void OnCancel() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
    }
    close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the peer"));
  }

  void OnDone() override {
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled = cancelled_;
    }
    if (on_end_) on_end_(cancelled);
    self_.reset();  // may delete this
  }

 private:
  StreamWriter() = default;
  void finish_locked(std::unique_lock<std::mutex>& lock) {
    if (finished_) return;
    finished_ = true;
    const grpc::Status status = status_;
    lock.unlock();
    this->Finish(status);
  }

  std::mutex mu_;
  std::deque<Msg> queue_;
  Msg current_;
  bool writing_ = false, closing_ = false, finished_ = false, cancelled_ = false;
  grpc::Status status_;
  std::function<void(bool)> on_end_;
  std::shared_ptr<StreamWriter> self_;
};

}  // namespace moelink::scheduler
