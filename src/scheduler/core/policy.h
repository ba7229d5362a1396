// Routing policies: which engine gets a request.
//
//   ttft          (default) the engine with the least estimated time to first
//                 token: its queued prefill work plus this prompt's uncached
//                 tokens, times its prefill cost per token, plus the wait for
//                 a batch slot when its batch is full; plus miss_weight times
//                 the prefill time of the uncached tokens, the work the
//                 request adds for the engine's later requests (without it a
//                 burst sharing a prefix would scatter: the second request
//                 finds the first one's prefill queued and an idle engine
//                 looks as fast, recomputing the whole prefix there); among
//                 the engines within the load bound (below).
//   round-robin   engines in turn.
//   least-loaded  the engine holding the fewest tokens.
//   prefix-only   the engine holding the longest prefix of the prompt; ties
//                 go to the least loaded. No load bound.
//
// Load bound (ttft): an engine is a candidate only if, with this request,
// its load stays within imbalance_bound x the mean load (after the request)
// + imbalance_slack_tokens; the least loaded engine is always a candidate.
// Load is the tokens an engine holds for unfinished requests (prompt plus
// output so far), the same quantity the benchmark's imbalance reports.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace moelink::scheduler {

enum class PolicyKind { kTtft, kRoundRobin, kLeastLoaded, kPrefixOnly };
const char* to_string(PolicyKind p);
// "ttft" | "round-robin" | "least-loaded" | "prefix-only"; throws
// std::invalid_argument naming the valid ones.
PolicyKind policy_from_string(const std::string& s);

struct PolicyOptions {
  double imbalance_bound = 1.5;
  uint64_t imbalance_slack_tokens = 8192;
  double miss_weight = 1.0;  // ttft: weight of the prefill work a request adds
};

// What a policy sees of one engine.
struct EngineView {
  int slot = -1;
  uint64_t load_tokens = 0;            // prompt + output tokens of unfinished requests
  uint64_t queued_prefill_tokens = 0;  // uncached prompt tokens not yet prefilled
  uint32_t running = 0;                // requests decoding
  uint32_t waiting = 0;                // requests waiting for prefill
  uint32_t max_batch = 1;
  uint64_t remaining_output_tokens = 0;  // still to generate by the running requests
  double prefill_us_per_token = 0;
  double decode_step_us = 0;
  uint32_t matched_tokens = 0;         // this prompt's prefix it holds
};

struct Choice {
  int slot = -1;                 // -1: no candidate
  uint32_t cached_tokens = 0;    // matched prefix tokens on that engine
  double estimated_ttft_us = 0;  // ttft policy only
};

// The ttft policy's estimate for one engine.
double estimated_ttft_us(const EngineView& e, uint32_t prompt_tokens);

class Policy {
 public:
  explicit Policy(const PolicyOptions& o) : options_(o) {}
  virtual ~Policy() = default;
  virtual PolicyKind kind() const = 0;
  // `engines`: the live engines, in slot order (non-empty).
  virtual Choice choose(uint32_t prompt_tokens, std::span<const EngineView> engines) = 0;
  // Whether a session stays on its engine `e`: while the engine holds at
  // most twice the load bound. Moving a session recomputes its whole
  // context elsewhere (a new request only its prompt), so sessions get more
  // room than new placements before they move.
  bool keeps_session(const EngineView& e, uint32_t prompt_tokens,
                     std::span<const EngineView> engines) const;

  static std::unique_ptr<Policy> make(PolicyKind kind, const PolicyOptions& options);

 protected:
  // The most load (tokens, this request included) an engine may hold.
  double load_limit(uint32_t prompt_tokens, std::span<const EngineView> engines) const;
  PolicyOptions options_;
};

}  // namespace moelink::scheduler
