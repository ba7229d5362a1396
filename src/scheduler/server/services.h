// The two gRPC services of proto/moelink/scheduler/v1/scheduler.proto, on
// the callback API: each call is a short trip into SchedulerCore; streams are
// StreamWriters the core writes to.
//
// Every method takes its request as raw bytes and parses it itself
// (parse_request.h): gRPC 1.51's callback handlers answer a request they
// cannot parse with UNIMPLEMENTED and no message, which a client cannot tell
// from a missing method, where the contract promises INVALID_ARGUMENT naming
// what is wrong. The generated WithRawCallbackMethod_* classes would make the
// responses raw too; registering the same handler templates they use with a
// raw request and a typed response keeps the responses (and StreamWriter)
// as they are. The method indices are the methods' order in the proto's
// service (the generated code's); test_server.cc's unparsable-request test
// names each method's message, so a mismatch fails there.
#pragma once
#include <grpcpp/support/byte_buffer.h>

#include "moelink/scheduler/v1/scheduler.grpc.pb.h"
#include "scheduler/core/scheduler_core.h"

namespace moelink::scheduler {

class EngineGatewayService final : public v1::EngineGateway::Service {
 public:
  EngineGatewayService(SchedulerCore& core, std::string engine_token);

 private:
  grpc::ServerUnaryReactor* on_register(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                        v1::RegisterResponse* resp);
  grpc::ServerWriteReactor<v1::Assignment>* on_receive_assignments(grpc::CallbackServerContext* ctx,
                                                                   const grpc::ByteBuffer* raw);
  grpc::ServerUnaryReactor* on_report(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                      v1::ReportResponse* resp);
  grpc::ServerUnaryReactor* on_leave(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                     v1::LeaveResponse* resp);

  SchedulerCore& core_;
  const std::string token_;
};

class FrontendService final : public v1::Frontend::Service {
 public:
  explicit FrontendService(SchedulerCore& core);

 private:
  grpc::ServerWriteReactor<v1::GenerateEvent>* on_generate(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* raw);
  grpc::ServerWriteReactor<v1::GenerateEvent>* on_resume(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* raw);
  grpc::ServerUnaryReactor* on_cancel(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                      v1::CancelResponse* resp);
  grpc::ServerUnaryReactor* on_get_stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                         v1::Stats* resp);

  SchedulerCore& core_;
};

}  // namespace moelink::scheduler
