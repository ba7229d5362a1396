#include "moelink/scheduler/engine_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "moelink/scheduler/v1/scheduler.grpc.pb.h"
#include "scheduler/client/channel.h"

namespace moelink::scheduler {

struct EngineClient::Impl {
  EngineClientOptions options;
  EngineHandlers handlers;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::EngineGateway::Stub> stub;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  bool connected = false;
  uint64_t incarnation = 0;
  uint32_t heartbeat_interval_ms = 500;
  std::string last_error = "not connected yet";
  std::shared_ptr<grpc::ClientContext> stream_ctx;  // the open assignment stream
  std::shared_ptr<grpc::ClientContext> register_ctx;  // a registration in flight

  std::mutex report_mu;  // serializes reports: seq order = send order
  uint64_t seq = 0;
  uint64_t seq_incarnation = 0;
  std::chrono::steady_clock::time_point last_report{};

  std::thread session, heartbeat;

  void prepare(grpc::ClientContext& ctx, bool deadline) const {
    if (!options.engine_token.empty())
      ctx.AddMetadata("authorization", "Bearer " + options.engine_token);
    if (deadline) ctx.set_deadline(std::chrono::system_clock::now() + options.rpc_timeout);
  }

  bool register_once() {
    v1::RegisterRequest req;
    *req.mutable_engine() = options.info;
    if (handlers.held)
      for (auto& h : handlers.held()) *req.add_held() = std::move(h);
    v1::RegisterResponse resp;
    auto ctx = std::make_shared<grpc::ClientContext>();
    prepare(*ctx, true);
    // Wait for the channel rather than fail at once while it reconnects: a
    // fail-fast call returns without polling the channel, and a sync-only
    // client has nothing else polling it but gRPC's backup poller (every 5
    // s), so after a scheduler restart the new connection went unnoticed
    // for 4-10 s, past the scheduler's recovery grace.
    ctx->set_wait_for_ready(true);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return false;
      register_ctx = ctx;
    }
    grpc::Status s = stub->Register(ctx.get(), req, &resp);
    {
      std::lock_guard<std::mutex> lock(mu);
      register_ctx.reset();
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      last_error = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                       ? "Register: no answer from the scheduler at " + options.target + " within " +
                             std::to_string(options.rpc_timeout.count()) + " ms (rpc_timeout): unreachable?"
                       : "Register: " + s.error_message();
      return false;
    }
    if (!resp.released().empty() && handlers.on_released)
      handlers.on_released({resp.released().begin(), resp.released().end()});
    std::lock_guard<std::mutex> lock(mu);
    incarnation = resp.incarnation();
    heartbeat_interval_ms = resp.heartbeat_interval_ms();
    return true;
  }

  // Reads assignments until the stream ends.
  void read_stream() {
    auto ctx = std::make_shared<grpc::ClientContext>();
    prepare(*ctx, false);
    v1::ReceiveAssignmentsRequest req;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      req.set_engine_id(options.info.engine_id());
      req.set_incarnation(incarnation);
      stream_ctx = ctx;
    }
    auto reader = stub->ReceiveAssignments(ctx.get(), req);
    v1::Assignment a;
    while (reader->Read(&a)) {
      if (a.has_run() && handlers.on_run) handlers.on_run(a.run());
      if (a.has_cancel() && handlers.on_cancel) handlers.on_cancel(a.cancel());
    }
    grpc::Status s = reader->Finish();
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    stream_ctx.reset();
    last_error = "assignment stream ended: " + s.error_message();
  }

  void session_loop() {
    auto backoff = std::chrono::milliseconds(50);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) return;
      }
      if (register_once()) {
        backoff = std::chrono::milliseconds(50);
        {
          std::lock_guard<std::mutex> lock(mu);
          connected = true;  // the stream opens next; reports may flow already
        }
        cv.notify_all();
        read_stream();
      }
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, backoff, [&] { return stopping; });
      backoff = std::min(backoff * 2, options.max_backoff);
    }
  }

  void heartbeat_loop() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      const auto period = std::chrono::milliseconds(std::max<uint32_t>(1, heartbeat_interval_ms / 2));
      cv.wait_for(lock, period, [&] { return stopping; });
      if (stopping || !connected) continue;
      lock.unlock();
      bool due;
      {
        std::lock_guard<std::mutex> rl(report_mu);
        due = std::chrono::steady_clock::now() - last_report >= period;
      }
      if (due) report(handlers.load ? handlers.load() : v1::EngineLoad{}, {}, {});
      lock.lock();
    }
  }

  // Forces a new registration (the scheduler fenced this incarnation).
  void reconnect() {
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    if (stream_ctx) stream_ctx->TryCancel();
  }

  ReportResult report(const v1::EngineLoad& load, std::vector<v1::KvEvent> events,
                      std::vector<v1::RequestProgress> progress) {
    ReportResult out;
    v1::EngineReport r;
    r.set_engine_id(options.info.engine_id());
    *r.mutable_load() = load;
    for (auto& e : events) *r.add_kv_events() = std::move(e);
    for (auto& p : progress) *r.add_progress() = std::move(p);
    v1::ReportResponse resp;
    {
      std::lock_guard<std::mutex> rl(report_mu);
      uint64_t inc;
      {
        std::lock_guard<std::mutex> lock(mu);
        inc = incarnation;
      }
      if (inc != seq_incarnation) {
        seq_incarnation = inc;
        seq = 0;
      }
      r.set_incarnation(inc);
      r.set_seq(++seq);
      grpc::ClientContext ctx;
      prepare(ctx, true);
      out.status = stub->Report(&ctx, r, &resp);
      last_report = std::chrono::steady_clock::now();
    }
    if (out.status.ok()) {
      out.revoked.assign(resp.revoked().begin(), resp.revoked().end());
      if (!out.revoked.empty() && handlers.on_released) handlers.on_released(out.revoked);
    } else if (out.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
               out.status.error_code() == grpc::StatusCode::NOT_FOUND) {
      reconnect();
    }
    return out;
  }
};

EngineClient::EngineClient(EngineClientOptions options, EngineHandlers handlers)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handlers = std::move(handlers);
  impl_->channel = make_channel(impl_->options.target, impl_->options.credentials);
  impl_->stub = v1::EngineGateway::NewStub(impl_->channel);
}

EngineClient::~EngineClient() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    if (impl_->stream_ctx) impl_->stream_ctx->TryCancel();
    if (impl_->register_ctx) impl_->register_ctx->TryCancel();  // waiting for an unreachable scheduler
  }
  impl_->cv.notify_all();
  if (impl_->session.joinable()) impl_->session.join();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
}

void EngineClient::start(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.session = std::thread([&m] { m.session_loop(); });
  m.heartbeat = std::thread([&m] { m.heartbeat_loop(); });
  std::unique_lock<std::mutex> lock(m.mu);
  if (!m.cv.wait_for(lock, timeout, [&] { return m.connected; }))
    throw std::runtime_error("engine '" + m.options.info.engine_id() + "' could not register with " +
                             m.options.target + " within " + std::to_string(timeout.count()) +
                             " ms: " + m.last_error);
}

ReportResult EngineClient::report(const v1::EngineLoad& load, std::vector<v1::KvEvent> kv_events,
                                  std::vector<v1::RequestProgress> progress) {
  return impl_->report(load, std::move(kv_events), std::move(progress));
}

grpc::Status EngineClient::leave(bool drain) {
  Impl& m = *impl_;
  v1::LeaveRequest req;
  req.set_engine_id(m.options.info.engine_id());
  req.set_incarnation(incarnation());
  req.set_drain(drain);
  v1::LeaveResponse resp;
  grpc::ClientContext ctx;
  m.prepare(ctx, true);
  grpc::Status s = m.stub->Leave(&ctx, req, &resp);
  if (!drain) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
    if (m.stream_ctx) m.stream_ctx->TryCancel();
    m.cv.notify_all();
  }
  return s;
}

uint64_t EngineClient::incarnation() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->incarnation;
}

bool EngineClient::connected() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->connected;
}

const std::string& EngineClient::engine_id() const { return impl_->options.info.engine_id(); }

}  // namespace moelink::scheduler
