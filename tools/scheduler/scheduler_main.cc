// moelink-scheduler: the request scheduler's gRPC server (docs/scheduler.md).
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "moelink/scheduler/server.h"
#include "moelink/version.h"
#include "scheduler/server/auth.h"

using moelink::scheduler::SchedulerOptions;
using moelink::scheduler::SchedulerServer;

int main(int argc, char** argv) {
  CLI::App app{"moelink-scheduler: routes requests to inference engines by KV-cache reuse and load"};
  app.set_version_flag("--version", std::string("moelink-scheduler ") + MOELINK_VERSION);
  SchedulerOptions o;
  std::string token_file, port_file;
  app.add_option("--listen", o.listen, "host:port to serve on (port 0: any free port)")
      ->capture_default_str();
  app.add_option("--policy", o.policy, "ttft | round-robin | least-loaded | prefix-only")
      ->check(CLI::IsMember({"ttft", "round-robin", "least-loaded", "prefix-only"}))
      ->capture_default_str();
  app.add_option("--imbalance-bound", o.imbalance_bound,
                 "ttft: an engine's load may reach bound x mean load + slack")
      ->check(CLI::Range(1.0, 100.0))->capture_default_str();
  app.add_option("--imbalance-slack-tokens", o.imbalance_slack_tokens, "see --imbalance-bound")
      ->capture_default_str();
  app.add_option("--miss-weight", o.miss_weight,
                 "ttft: weight of the prefill work a request adds (its uncached tokens)")
      ->check(CLI::Range(0.0, 100.0))->capture_default_str();
  app.add_option("--block-size", o.block_size, "tokens per KV block (every engine's)")
      ->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--max-prompt-tokens", o.max_prompt_tokens, "longest prompt accepted")
      ->check(CLI::Range(1, 1 << 24))->capture_default_str();
  app.add_option("--max-new-tokens", o.max_new_tokens, "largest sampling.max_new_tokens accepted")
      ->check(CLI::Range(1, 1 << 24))->capture_default_str();
  app.add_option("--heartbeat-interval-ms", o.heartbeat_interval_ms, "engines report at least this often")
      ->check(CLI::Range(1, 600000))->capture_default_str();
  app.add_option("--heartbeat-timeout-ms", o.heartbeat_timeout_ms, "an engine silent this long is drained")
      ->check(CLI::Range(2, 3600000))->capture_default_str();
  app.add_option("--provisional-ttl-ms", o.provisional_ttl_ms,
                 "routed prefixes count as cached this long before the engine's events")
      ->capture_default_str();
  app.add_option("--queue-timeout-ms", o.queue_timeout_ms, "a request no engine can take fails after this")
      ->check(CLI::Range(1, 86400000))->capture_default_str();
  app.add_option("--retention-ms", o.retention_ms, "finished requests stay resumable this long")
      ->capture_default_str();
  app.add_option("--recovery-grace-ms", o.recovery_grace_ms,
                 "after a restart, engines have this long to claim logged requests (0: the heartbeat timeout)")
      ->capture_default_str();
  app.add_option("--session-ttl-ms", o.session_ttl_ms, "a sticky session is forgotten after this idle time")
      ->capture_default_str();
  app.add_option("--default-prefill-us-per-token", o.default_prefill_us_per_token,
                 "cost model for engines that send none")->capture_default_str();
  app.add_option("--default-decode-step-us", o.default_decode_step_us, "see above")->capture_default_str();
  app.add_option("--request-log", o.request_log,
                 "write-ahead log of accepted requests (restart without losing them); default: none");
  app.add_option("--engine-token-file", token_file,
                 "file holding the shared engine token (or $MOELINK_ENGINE_TOKEN)");
  app.add_option("--tls-cert", o.tls_cert, "PEM certificate chain: serve TLS");
  app.add_option("--tls-key", o.tls_key, "PEM private key for --tls-cert");
  app.add_option("--tls-client-ca", o.tls_client_ca, "PEM CA: require client certificates (mTLS)");
  app.add_flag("--allow-insecure-remote", o.allow_insecure_remote,
               "listen beyond loopback without a token or TLS");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  CLI11_PARSE(app, argc, argv);

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  try {
    if (!token_file.empty()) {
      o.engine_token = moelink::scheduler::read_token_file(token_file);
    } else if (const char* t = std::getenv("MOELINK_ENGINE_TOKEN")) {
      o.engine_token = t;
    }
    SchedulerServer server(o);
    std::fprintf(stderr, "moelink-scheduler %s: serving on port %d, policy %s%s%s\n", MOELINK_VERSION,
                 server.port(), o.policy.c_str(), o.request_log.empty() ? "" : ", request log ",
                 o.request_log.c_str());
    if (!port_file.empty()) {
      std::ofstream tmp(port_file + ".tmp");
      tmp << server.port() << "\n";
      tmp.close();
      std::rename((port_file + ".tmp").c_str(), port_file.c_str());
    }
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&signals, &sig);
      server.shutdown();
    });
    server.wait();
    waiter.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-scheduler: error: %s\n", e.what());
    return 2;
  }
}
