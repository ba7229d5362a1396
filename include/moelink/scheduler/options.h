// moelink-scheduler's options (the command line's flags, one for one).
#pragma once
#include <cstdint>
#include <string>

namespace moelink::scheduler {

struct SchedulerOptions {
  // ---- serving
  std::string listen = "127.0.0.1:50051";  // host:port; port 0 picks a free one
  // ---- routing (docs/scheduler.md, "Policies")
  std::string policy = "ttft";             // ttft | round-robin | least-loaded | prefix-only
  double imbalance_bound = 1.5;            // ttft: load <= bound x mean + slack
  uint64_t imbalance_slack_tokens = 8192;
  double miss_weight = 1.0;                // ttft: weight of the prefill work a request adds
  uint32_t block_size = 16;                // tokens per KV block, every engine's
  uint32_t max_prompt_tokens = 131072;
  uint32_t max_new_tokens = 32768;
  uint32_t provisional_ttl_ms = 5000;      // routed blocks count as held this long without events
  uint32_t session_ttl_ms = 600000;        // a sticky session is forgotten after this idle time
  double default_prefill_us_per_token = 100;  // for engines that send no cost model
  double default_decode_step_us = 30000;
  // ---- failures
  uint32_t heartbeat_interval_ms = 500;    // engines report at least this often
  uint32_t heartbeat_timeout_ms = 2000;    // silent this long: drained
  uint32_t queue_timeout_ms = 30000;       // a request no engine can take fails after this
  uint32_t retention_ms = 60000;           // a finished request stays resumable this long
  uint32_t recovery_grace_ms = 10000;      // after a restart, engines have this long to claim
                                           // logged requests (0: heartbeat_timeout_ms)
  std::string request_log;                 // write-ahead log path; empty: none
  // ---- security (off by default; required to listen beyond loopback)
  std::string engine_token;                // engines send "authorization: Bearer <token>"
  std::string tls_cert, tls_key;           // PEM files: serve TLS
  std::string tls_client_ca;               // PEM file: require client certificates (mTLS)
  bool allow_insecure_remote = false;      // listen beyond loopback without either

  // Throws std::invalid_argument naming the option, its value and the allowed range.
  void validate() const;
};

}  // namespace moelink::scheduler
