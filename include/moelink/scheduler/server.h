// moelink-scheduler in a process: the gRPC server (EngineGateway + Frontend,
// proto/moelink/scheduler/v1/scheduler.proto) around the scheduler core.
//
//   moelink::scheduler::SchedulerOptions o;
//   o.listen = "127.0.0.1:0";            // any free port
//   moelink::scheduler::SchedulerServer server(o);
//   connect engines and clients to "127.0.0.1:" + std::to_string(server.port())
//   server.wait();                       // until shutdown()
#pragma once
#include <memory>

#include "moelink/scheduler/options.h"

namespace moelink::scheduler {

class SchedulerServer {
 public:
  // Validates the options, replays the request log (if any), starts serving.
  // Throws std::invalid_argument (bad option) or std::runtime_error (cannot
  // bind, cannot open the log).
  explicit SchedulerServer(const SchedulerOptions& options);
  ~SchedulerServer();  // shutdown() and wait
  SchedulerServer(const SchedulerServer&) = delete;
  SchedulerServer& operator=(const SchedulerServer&) = delete;

  int port() const;
  // Blocks until shutdown() is called (from another thread or a signal handler thread).
  void wait();
  // Stops accepting calls, ends open streams (UNAVAILABLE), flushes the log.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelink::scheduler
