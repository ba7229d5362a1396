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
  return grpc::CreateCustomChannel(
      target, credentials ? credentials : grpc::InsecureChannelCredentials(), args);
}

}  // namespace moelink::scheduler
