// Submitting requests to moelink-scheduler from C++ (the Python twin is
// moelink.scheduler.SchedulerClient).
//
//   SchedulerClient client("127.0.0.1:50051");
//   v1::GenerateRequest req;
//   req.mutable_prompt_tokens()->Add(...);           // a tokenizer's output
//   req.mutable_sampling()->set_max_new_tokens(128);
//   grpc::Status s = client.generate(req, [](const v1::GenerateEvent& ev) {
//     if (ev.has_tokens()) ...;                      // output as it comes
//   });
#pragma once
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "moelink/scheduler/v1/scheduler.pb.h"

namespace moelink::scheduler {

class SchedulerClient {
 public:
  using OnEvent = std::function<void(const v1::GenerateEvent&)>;
  explicit SchedulerClient(const std::string& target,
                           std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~SchedulerClient();

  // Submits a request and calls on_event for each event (Accepted, Tokens...,
  // Finished; or Redirect) until the stream ends; returns its status.
  // timeout 0: none.
  grpc::Status generate(const v1::GenerateRequest& req, const OnEvent& on_event,
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Reattaches to an accepted request (after a lost stream or a scheduler restart).
  grpc::Status resume(const v1::ResumeRequest& req, const OnEvent& on_event,
                      std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  grpc::Status cancel(const std::string& request_id);
  grpc::Status stats(v1::Stats* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelink::scheduler
