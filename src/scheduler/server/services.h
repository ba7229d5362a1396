// The two gRPC services of proto/moelink/scheduler/v1/scheduler.proto, on
// the callback API: each call is a short trip into SchedulerCore; streams are
// StreamWriters the core writes to.
#pragma once
#include "moelink/scheduler/v1/scheduler.grpc.pb.h"
#include "scheduler/core/scheduler_core.h"

namespace moelink::scheduler {

class EngineGatewayService final : public v1::EngineGateway::CallbackService {
 public:
  EngineGatewayService(SchedulerCore& core, std::string engine_token)
      : core_(core), token_(std::move(engine_token)) {}
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* req,
                                     v1::RegisterResponse* resp) override;
  grpc::ServerWriteReactor<v1::Assignment>* ReceiveAssignments(
      grpc::CallbackServerContext* ctx, const v1::ReceiveAssignmentsRequest* req) override;
  grpc::ServerUnaryReactor* Report(grpc::CallbackServerContext* ctx, const v1::EngineReport* req,
                                   v1::ReportResponse* resp) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* req,
                                  v1::LeaveResponse* resp) override;

 private:
  SchedulerCore& core_;
  const std::string token_;
};

class FrontendService final : public v1::Frontend::CallbackService {
 public:
  explicit FrontendService(SchedulerCore& core) : core_(core) {}
  grpc::ServerWriteReactor<v1::GenerateEvent>* Generate(grpc::CallbackServerContext* ctx,
                                                        const v1::GenerateRequest* req) override;
  grpc::ServerWriteReactor<v1::GenerateEvent>* Resume(grpc::CallbackServerContext* ctx,
                                                      const v1::ResumeRequest* req) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx, const v1::CancelRequest* req,
                                   v1::CancelResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                     v1::Stats* resp) override;

 private:
  SchedulerCore& core_;
};

}  // namespace moelink::scheduler
