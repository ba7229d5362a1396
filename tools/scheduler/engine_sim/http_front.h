// The simulator's HTTP front end, compatible with what sglang-router expects
// of an SGLang server (GET /health, /server_info, /model_info; POST
// /generate with text or input_ids, streamed as server-sent events), so the
// same simulated engines can sit behind sglang-router for the benchmark, or
// take redirected requests.
#pragma once
#include <memory>
#include <string>

#include "sim_engine.h"

namespace moelink::scheduler::sim {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  int threads = 256;          // concurrent requests it can stream
  uint32_t stream_interval = 1;  // output tokens per streamed chunk (the first goes at once)
};

class HttpFront {
 public:
  HttpFront(SimEngine& engine, const HttpOptions& o);
  ~HttpFront();
  void start();  // binds (throws std::runtime_error if it cannot) and serves in a thread
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelink::scheduler::sim
