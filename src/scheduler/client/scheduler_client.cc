#include "moelink/scheduler/client.h"

#include <grpcpp/client_context.h>

#include "moelink/scheduler/v1/scheduler.grpc.pb.h"
#include "scheduler/client/channel.h"

namespace moelink::scheduler {

struct SchedulerClient::Impl {
  std::unique_ptr<v1::Frontend::Stub> stub;
};

namespace {

void set_timeout(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) {
  if (timeout.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + timeout);
}

template <class Reader>
grpc::Status drain(Reader& reader, const SchedulerClient::OnEvent& on_event) {
  v1::GenerateEvent ev;
  while (reader->Read(&ev))
    if (on_event) on_event(ev);
  return reader->Finish();
}

}  // namespace

SchedulerClient::SchedulerClient(const std::string& target,
                                 std::shared_ptr<grpc::ChannelCredentials> credentials)
    : impl_(std::make_unique<Impl>()) {
  impl_->stub = v1::Frontend::NewStub(make_channel(target, std::move(credentials)));
}

SchedulerClient::~SchedulerClient() = default;

grpc::Status SchedulerClient::generate(const v1::GenerateRequest& req, const OnEvent& on_event,
                                       std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  set_timeout(ctx, timeout);
  auto reader = impl_->stub->Generate(&ctx, req);
  return drain(reader, on_event);
}

grpc::Status SchedulerClient::resume(const v1::ResumeRequest& req, const OnEvent& on_event,
                                     std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  set_timeout(ctx, timeout);
  auto reader = impl_->stub->Resume(&ctx, req);
  return drain(reader, on_event);
}

grpc::Status SchedulerClient::cancel(const std::string& request_id) {
  grpc::ClientContext ctx;
  set_timeout(ctx, std::chrono::milliseconds(5000));
  v1::CancelRequest req;
  req.set_request_id(request_id);
  v1::CancelResponse resp;
  return impl_->stub->Cancel(&ctx, req, &resp);
}

grpc::Status SchedulerClient::stats(v1::Stats* out) {
  grpc::ClientContext ctx;
  set_timeout(ctx, std::chrono::milliseconds(5000));
  return impl_->stub->GetStats(&ctx, v1::StatsRequest{}, out);
}

}  // namespace moelink::scheduler
