#include "scheduler/server/auth.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace moelink::scheduler {

grpc::Status check_engine_token(const grpc::CallbackServerContext& ctx, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const std::string want = "Bearer " + token;
  const auto& md = ctx.client_metadata();
  for (auto it = md.find(kAuthorizationKey); it != md.end() && it->first == kAuthorizationKey; ++it) {
    const grpc::string_ref& v = it->second;
    if (v.size() != want.size()) continue;
    // Constant time in the token's length.
    unsigned char diff = 0;
    for (size_t i = 0; i < want.size(); ++i)
      diff |= static_cast<unsigned char>(v.data()[i] ^ want[i]);
    if (diff == 0) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "engine token missing or wrong: send metadata 'authorization: Bearer "
                      "<token>' with the token the scheduler was given (--engine-token-file or "
                      "$MOELINK_ENGINE_TOKEN)");
}

bool is_loopback_listen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string read_pem(const std::string& path, const char* option) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(std::string(option) + " " + path + ": cannot read (" +
                             std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string read_token_file(const std::string& path) {
  std::string token = read_pem(path, "--engine-token-file");
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  return token;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const SchedulerOptions& o) {
  const bool tls = !o.tls_cert.empty();
  if (!is_loopback_listen(o.listen) && !tls && o.engine_token.empty() && !o.allow_insecure_remote)
    throw std::invalid_argument(
        "listen " + o.listen +
        " reaches beyond loopback, but engines would be unauthenticated: pass --engine-token-file "
        "(or set $MOELINK_ENGINE_TOKEN) or --tls-cert/--tls-key (with --tls-client-ca for mTLS), or --allow-insecure-remote");
  if (!tls) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      o.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!o.tls_client_ca.empty()) ssl.pem_root_certs = read_pem(o.tls_client_ca, "--tls-client-ca");
  ssl.pem_key_cert_pairs.push_back({read_pem(o.tls_key, "--tls-key"), read_pem(o.tls_cert, "--tls-cert")});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace moelink::scheduler
