#include "moelink/scheduler/server.h"

#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <condition_variable>
#include <stdexcept>
#include <thread>

#include "scheduler/core/request_log.h"
#include "scheduler/core/scheduler_core.h"
#include "scheduler/server/auth.h"
#include "scheduler/server/services.h"

namespace moelink::scheduler {

// How often the core's clock work runs (heartbeat deadlines, re-routing,
// client cancellations); well below every deadline it enforces.
constexpr auto kTickPeriod = std::chrono::milliseconds(10);
// Prompts of 131072 tokens and engines re-registering with their outputs
// exceed gRPC's 4 MiB default.
constexpr int kMaxMessageBytes = 256 << 20;

struct SchedulerServer::Impl {
  SchedulerOptions options;
  std::unique_ptr<RequestLog> log;
  std::unique_ptr<SchedulerCore> core;
  std::unique_ptr<EngineGatewayService> engines;
  std::unique_ptr<FrontendService> frontend;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false, stopped = false;
  std::thread ticker;

  void tick_loop() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      lock.unlock();
      core->tick(Clock::now());
      lock.lock();
      cv.wait_for(lock, kTickPeriod, [&] { return stopping; });
    }
  }
};

SchedulerServer::SchedulerServer(const SchedulerOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  options.validate();
  auto credentials = server_credentials(options);
  std::vector<RequestLog::LiveRequest> recovered;
  if (!options.request_log.empty())
    m.log = std::make_unique<RequestLog>(options.request_log, &recovered);
  m.core = std::make_unique<SchedulerCore>(options, m.log.get(), std::move(recovered), Clock::now());
  m.engines = std::make_unique<EngineGatewayService>(*m.core, options.engine_token);
  m.frontend = std::make_unique<FrontendService>(*m.core);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &m.port);
  builder.RegisterService(m.engines.get());
  builder.RegisterService(m.frontend.get());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  m.server = builder.BuildAndStart();
  if (!m.server || m.port == 0)
    throw std::runtime_error("cannot listen on " + options.listen + " (address in use or invalid)");
  m.ticker = std::thread([&m] { m.tick_loop(); });
}

SchedulerServer::~SchedulerServer() { shutdown(); }

int SchedulerServer::port() const { return impl_->port; }

void SchedulerServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->stopped; });
}

void SchedulerServer::shutdown() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.stopping) return;
    m.stopping = true;
  }
  m.cv.notify_all();
  // The clock stops first: streams that shutdown cancels must not count as
  // clients that went away (their requests stay in the log, live).
  if (m.ticker.joinable()) m.ticker.join();
  m.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  m.server->Wait();
  m.log.reset();  // flushes; its callbacks still find the core
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopped = true;
  }
  m.cv.notify_all();
}

}  // namespace moelink::scheduler
