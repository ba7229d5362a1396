#include "scheduler/server/services.h"

#include "scheduler/server/auth.h"
#include "scheduler/server/parse_request.h"
#include "scheduler/server/stream_writer.h"

namespace moelink::scheduler {
namespace {

grpc::ServerUnaryReactor* done(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(status);
  return r;
}

// A stream that ends at once with `status`.
template <class Msg>
grpc::ServerWriteReactor<Msg>* refused(const grpc::Status& status) {
  auto w = StreamWriter<Msg>::create();
  w->close(status);
  return w.get();
}

// The handlers gRPC's generated code registers, with a raw request (see services.h).
template <class Resp, class F>
grpc::internal::MethodHandler* unary(F f) {
  return new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, Resp>(std::move(f));
}
template <class Msg, class F>
grpc::internal::MethodHandler* server_streaming(F f) {
  return new grpc::internal::CallbackServerStreamingHandler<grpc::ByteBuffer, Msg>(std::move(f));
}

}  // namespace

// ------------------------------------------------------------------ engines

EngineGatewayService::EngineGatewayService(SchedulerCore& core, std::string engine_token)
    : core_(core), token_(std::move(engine_token)) {
  using Ctx = grpc::CallbackServerContext;
  using Raw = grpc::ByteBuffer;
  MarkMethodCallback(0, unary<v1::RegisterResponse>([this](Ctx* c, const Raw* r, v1::RegisterResponse* o) {
                       return on_register(c, r, o);
                     }));
  MarkMethodCallback(1, server_streaming<v1::Assignment>(
                            [this](Ctx* c, const Raw* r) { return on_receive_assignments(c, r); }));
  MarkMethodCallback(2, unary<v1::ReportResponse>([this](Ctx* c, const Raw* r, v1::ReportResponse* o) {
                       return on_report(c, r, o);
                     }));
  MarkMethodCallback(3, unary<v1::LeaveResponse>([this](Ctx* c, const Raw* r, v1::LeaveResponse* o) {
                       return on_leave(c, r, o);
                     }));
}

// The engine token is checked before the request is parsed: a caller without
// it learns nothing about what it sent.
grpc::ServerUnaryReactor* EngineGatewayService::on_register(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* raw,
                                                            v1::RegisterResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  v1::RegisterRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return done(ctx, s);
  return done(ctx, core_.register_engine(req, resp, Clock::now()));
}

grpc::ServerWriteReactor<v1::Assignment>* EngineGatewayService::on_receive_assignments(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return refused<v1::Assignment>(s);
  v1::ReceiveAssignmentsRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return refused<v1::Assignment>(s);
  auto w = StreamWriter<v1::Assignment>::create();
  const EngineSink* sink = w.get();
  w->set_on_end([this, id = req.engine_id(), sink](bool) { core_.engine_stream_closed(id, sink); });
  if (auto s = core_.attach_engine(req, w, Clock::now()); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerUnaryReactor* EngineGatewayService::on_report(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* raw,
                                                          v1::ReportResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  v1::EngineReport req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return done(ctx, s);
  return done(ctx, core_.report(req, resp, Clock::now()));
}

grpc::ServerUnaryReactor* EngineGatewayService::on_leave(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* raw,
                                                         v1::LeaveResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  v1::LeaveRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return done(ctx, s);
  return done(ctx, core_.leave(req, resp, Clock::now()));
}

// ------------------------------------------------------------------ clients

FrontendService::FrontendService(SchedulerCore& core) : core_(core) {
  using Ctx = grpc::CallbackServerContext;
  using Raw = grpc::ByteBuffer;
  MarkMethodCallback(0, server_streaming<v1::GenerateEvent>(
                            [this](Ctx* c, const Raw* r) { return on_generate(c, r); }));
  MarkMethodCallback(1, server_streaming<v1::GenerateEvent>(
                            [this](Ctx* c, const Raw* r) { return on_resume(c, r); }));
  MarkMethodCallback(2, unary<v1::CancelResponse>([this](Ctx* c, const Raw* r, v1::CancelResponse* o) {
                       return on_cancel(c, r, o);
                     }));
  MarkMethodCallback(3, unary<v1::Stats>([this](Ctx* c, const Raw* r, v1::Stats* o) {
                       return on_get_stats(c, r, o);
                     }));
}

grpc::ServerWriteReactor<v1::GenerateEvent>* FrontendService::on_generate(grpc::CallbackServerContext*,
                                                                          const grpc::ByteBuffer* raw) {
  v1::GenerateRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return refused<v1::GenerateEvent>(s);
  auto w = StreamWriter<v1::GenerateEvent>::create();
  // Name the request here so the stream's end can refer to it.
  if (req.request_id().empty()) req.set_request_id(SchedulerCore::new_request_id());
  const ClientSink* sink = w.get();
  w->set_on_end([this, id = req.request_id(), sink](bool cancelled) {
    if (cancelled) core_.client_gone(id, sink);
  });
  if (auto s = core_.submit(std::move(req), w, Clock::now()); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerWriteReactor<v1::GenerateEvent>* FrontendService::on_resume(grpc::CallbackServerContext*,
                                                                        const grpc::ByteBuffer* raw) {
  v1::ResumeRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return refused<v1::GenerateEvent>(s);
  auto w = StreamWriter<v1::GenerateEvent>::create();
  const ClientSink* sink = w.get();
  w->set_on_end([this, id = req.request_id(), sink](bool cancelled) {
    if (cancelled) core_.client_gone(id, sink);
  });
  if (auto s = core_.resume(req, w); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerUnaryReactor* FrontendService::on_cancel(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* raw, v1::CancelResponse*) {
  v1::CancelRequest req;
  if (auto s = parse_request(*raw, &req); !s.ok()) return done(ctx, s);
  return done(ctx, core_.cancel(req.request_id()));
}

grpc::ServerUnaryReactor* FrontendService::on_get_stats(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* raw, v1::Stats* resp) {
  v1::StatsRequest req;  // empty, but bytes that are not one are still refused
  if (auto s = parse_request(*raw, &req); !s.ok()) return done(ctx, s);
  core_.stats(resp);
  return done(ctx, grpc::Status::OK);
}

}  // namespace moelink::scheduler
