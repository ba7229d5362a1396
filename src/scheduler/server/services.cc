#include "scheduler/server/services.h"

#include "scheduler/server/auth.h"
#include "scheduler/server/stream_writer.h"

namespace moelink::scheduler {
namespace {

grpc::ServerUnaryReactor* done(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(status);
  return r;
}

}  // namespace

// ------------------------------------------------------------------ engines

grpc::ServerUnaryReactor* EngineGatewayService::Register(grpc::CallbackServerContext* ctx,
                                                         const v1::RegisterRequest* req,
                                                         v1::RegisterResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  return done(ctx, core_.register_engine(*req, resp, Clock::now()));
}

grpc::ServerWriteReactor<v1::Assignment>* EngineGatewayService::ReceiveAssignments(
    grpc::CallbackServerContext* ctx, const v1::ReceiveAssignmentsRequest* req) {
  auto w = StreamWriter<v1::Assignment>::create();
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) {
    w->close(s);
    return w.get();
  }
  const EngineSink* raw = w.get();
  w->set_on_end([this, id = req->engine_id(), raw](bool) { core_.engine_stream_closed(id, raw); });
  if (auto s = core_.attach_engine(*req, w, Clock::now()); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerUnaryReactor* EngineGatewayService::Report(grpc::CallbackServerContext* ctx,
                                                       const v1::EngineReport* req,
                                                       v1::ReportResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  return done(ctx, core_.report(*req, resp, Clock::now()));
}

grpc::ServerUnaryReactor* EngineGatewayService::Leave(grpc::CallbackServerContext* ctx,
                                                      const v1::LeaveRequest* req,
                                                      v1::LeaveResponse* resp) {
  if (auto s = check_engine_token(*ctx, token_); !s.ok()) return done(ctx, s);
  return done(ctx, core_.leave(*req, resp, Clock::now()));
}

// ------------------------------------------------------------------ clients

grpc::ServerWriteReactor<v1::GenerateEvent>* FrontendService::Generate(
    grpc::CallbackServerContext*, const v1::GenerateRequest* req) {
  auto w = StreamWriter<v1::GenerateEvent>::create();
  // Name the request here so the stream's end can refer to it.
  v1::GenerateRequest named = *req;
  if (named.request_id().empty()) named.set_request_id(SchedulerCore::new_request_id());
  const ClientSink* raw = w.get();
  w->set_on_end([this, id = named.request_id(), raw](bool cancelled) {
    if (cancelled) core_.client_gone(id, raw);
  });
  if (auto s = core_.submit(std::move(named), w, Clock::now()); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerWriteReactor<v1::GenerateEvent>* FrontendService::Resume(grpc::CallbackServerContext*,
                                                                     const v1::ResumeRequest* req) {
  auto w = StreamWriter<v1::GenerateEvent>::create();
  const ClientSink* raw = w.get();
  w->set_on_end([this, id = req->request_id(), raw](bool cancelled) {
    if (cancelled) core_.client_gone(id, raw);
  });
  if (auto s = core_.resume(*req, w); !s.ok()) w->close(s);
  return w.get();
}

grpc::ServerUnaryReactor* FrontendService::Cancel(grpc::CallbackServerContext* ctx,
                                                  const v1::CancelRequest* req, v1::CancelResponse*) {
  return done(ctx, core_.cancel(req->request_id()));
}

grpc::ServerUnaryReactor* FrontendService::GetStats(grpc::CallbackServerContext* ctx,
                                                    const v1::StatsRequest*, v1::Stats* resp) {
  core_.stats(resp);
  return done(ctx, grpc::Status::OK);
}

}  // namespace moelink::scheduler
