// A channel to the scheduler with the message size limits its server uses.
#pragma once
#include <grpcpp/channel.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

namespace moelink::scheduler {

inline std::shared_ptr<grpc::Channel> make_channel(
    const std::string& target, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  // gRPC's default reconnect backoff grows to 120 s, and a channel waiting
  // to reconnect fails every call at once: after a scheduler restart engines
  // would come back long after its recovery grace. Retry within a second.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(
      target, credentials ? credentials : grpc::InsecureChannelCredentials(), args);
}

}  // namespace moelink::scheduler
