// The engine side of the scheduler protocol, for C++ engines (the Python
// twin is moelink.scheduler.EngineClient).
//
//   EngineClient client(options, handlers);
//   client.start(std::chrono::seconds(10));      // registered, assignment stream open
//   ... each engine step:
//   auto r = client.report(load, kv_events, progress);  // STARTED first, then prefill
//
// The client keeps the engine registered: when the assignment stream breaks
// or a report is refused because the scheduler fenced this incarnation, it
// registers again (with the requests the engine still holds, from
// handlers.held) and reopens the stream, backing off while the scheduler is
// unreachable. Between steps it sends heartbeats (handlers.load) so an idle
// engine stays alive.
#pragma once
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moelink/scheduler/v1/scheduler.pb.h"

namespace moelink::scheduler {

struct EngineClientOptions {
  std::string target = "127.0.0.1:50051";  // the scheduler, host:port
  v1::EngineInfo info;                     // engine_id, capacity, block size, ...
  std::string engine_token;                // the scheduler's engine token, if it has one
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // default: insecure
  std::chrono::milliseconds rpc_timeout{5000};
  std::chrono::milliseconds max_backoff{1000};
};

struct EngineHandlers {
  // A request to run (from the assignment stream's thread). Queue it; report
  // STARTED and wait for the ack before its prefill.
  std::function<void(const v1::RunRequest&)> on_run;
  // Stop a request: cancelled by its client or re-routed. Drop it without output.
  std::function<void(const v1::CancelRun&)> on_cancel;
  // The requests the engine holds, for (re)registering. May be empty.
  std::function<std::vector<v1::HeldRequest>()> held;
  // Requests the scheduler no longer gives to this engine: drop them.
  std::function<void(const std::vector<std::string>&)> on_released;
  // The engine's current load, for heartbeats.
  std::function<v1::EngineLoad()> load;
};

struct ReportResult {
  grpc::Status status;
  std::vector<std::string> revoked;  // drop these; never start them
};

class EngineClient {
 public:
  EngineClient(EngineClientOptions options, EngineHandlers handlers);
  ~EngineClient();  // stops (no Leave: call leave() first to leave cleanly)
  EngineClient(const EngineClient&) = delete;
  EngineClient& operator=(const EngineClient&) = delete;

  // Registers and opens the assignment stream; throws std::runtime_error
  // with the scheduler's last answer if that does not happen within `timeout`.
  void start(std::chrono::milliseconds timeout);
  // One report (thread-safe; the sequence number is the client's). Revoked
  // requests are also passed to handlers.on_released.
  ReportResult report(const v1::EngineLoad& load, std::vector<v1::KvEvent> kv_events,
                      std::vector<v1::RequestProgress> progress);
  // Leaves the pool (drain: finish what it holds first) and stops reconnecting.
  grpc::Status leave(bool drain);
  uint64_t incarnation() const;
  bool connected() const;
  const std::string& engine_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelink::scheduler
