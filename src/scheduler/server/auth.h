// Who may talk to the scheduler: the engine token, TLS/mTLS credentials, and
// the rule that a scheduler listening beyond loopback needs one of them.
#pragma once
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <string>

#include "moelink/scheduler/options.h"

namespace moelink::scheduler {

// The metadata key engines put their token under ("authorization: Bearer <token>").
inline constexpr char kAuthorizationKey[] = "authorization";

// OK, or UNAUTHENTICATED when a token is configured and the call lacks it.
grpc::Status check_engine_token(const grpc::CallbackServerContext& ctx, const std::string& token);

// Whether `listen` (host:port) binds only a loopback address.
bool is_loopback_listen(const std::string& listen);

// The server credentials the options ask for (insecure, TLS or mTLS). Throws
// std::invalid_argument when listening beyond loopback without a token or
// TLS and without allow_insecure_remote, std::runtime_error when a PEM file
// cannot be read.
std::shared_ptr<grpc::ServerCredentials> server_credentials(const SchedulerOptions& o);

// Reads a whole file; throws std::runtime_error naming it.
std::string read_pem(const std::string& path, const char* option);

// The engine token in a file (--engine-token-file), its trailing newlines
// dropped; throws std::runtime_error naming the file.
std::string read_token_file(const std::string& path);

}  // namespace moelink::scheduler
