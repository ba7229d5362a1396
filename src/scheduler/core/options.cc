#include <cmath>
#include <stdexcept>

#include "moelink/scheduler/options.h"
#include "scheduler/core/policy.h"

namespace moelink::scheduler {
namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

void in_range(const char* name, uint64_t v, uint64_t lo, uint64_t hi) {
  need(v >= lo && v <= hi, std::string(name) + " " + std::to_string(v) + " is outside " +
                               std::to_string(lo) + ".." + std::to_string(hi));
}

void positive_finite(const char* name, double v) {
  need(std::isfinite(v) && v > 0, std::string(name) + " " + std::to_string(v) + " must be > 0");
}

}  // namespace

void SchedulerOptions::validate() const {
  need(listen.rfind(':') != std::string::npos,
       "listen '" + listen + "' must be host:port, e.g. 127.0.0.1:50051");
  policy_from_string(policy);
  need(std::isfinite(imbalance_bound) && imbalance_bound >= 1.0 && imbalance_bound <= 100,
       "imbalance_bound " + std::to_string(imbalance_bound) + " is outside 1..100");
  need(std::isfinite(miss_weight) && miss_weight >= 0 && miss_weight <= 100,
       "miss_weight " + std::to_string(miss_weight) + " is outside 0..100");
  in_range("block_size", block_size, 1, 4096);
  in_range("max_prompt_tokens", max_prompt_tokens, 1, 1u << 24);
  in_range("max_new_tokens", max_new_tokens, 1, 1u << 24);
  in_range("heartbeat_interval_ms", heartbeat_interval_ms, 1, 600000);
  in_range("heartbeat_timeout_ms", heartbeat_timeout_ms, heartbeat_interval_ms + 1, 3600000);
  in_range("queue_timeout_ms", queue_timeout_ms, 1, 86400000);
  positive_finite("default_prefill_us_per_token", default_prefill_us_per_token);
  positive_finite("default_decode_step_us", default_decode_step_us);
  need(tls_cert.empty() == tls_key.empty(), "tls_cert and tls_key go together (both or neither)");
  need(tls_client_ca.empty() || !tls_cert.empty(), "tls_client_ca (mTLS) needs tls_cert and tls_key");
}

}  // namespace moelink::scheduler
