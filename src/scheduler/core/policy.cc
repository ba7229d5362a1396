#include "scheduler/core/policy.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace moelink::scheduler {

const char* to_string(PolicyKind p) {
  switch (p) {
    case PolicyKind::kTtft: return "ttft";
    case PolicyKind::kRoundRobin: return "round-robin";
    case PolicyKind::kLeastLoaded: return "least-loaded";
    case PolicyKind::kPrefixOnly: return "prefix-only";
  }
  return "?";
}

PolicyKind policy_from_string(const std::string& s) {
  for (PolicyKind p : {PolicyKind::kTtft, PolicyKind::kRoundRobin, PolicyKind::kLeastLoaded,
                       PolicyKind::kPrefixOnly})
    if (s == to_string(p)) return p;
  throw std::invalid_argument("policy '" + s +
                              "' is unknown; valid: ttft, round-robin, least-loaded, prefix-only");
}

double estimated_ttft_us(const EngineView& e, uint32_t prompt_tokens) {
  const uint32_t uncached = prompt_tokens > e.matched_tokens ? prompt_tokens - e.matched_tokens : 0;
  double us = e.prefill_us_per_token * static_cast<double>(e.queued_prefill_tokens + uncached);
  // A full batch: the request waits for slots to free. With R running
  // requests that still owe T tokens in total, one slot frees every T/R^2
  // steps on average (each finishes after ~T/R steps; R of them).
  const uint64_t occupied = static_cast<uint64_t>(e.running) + e.waiting + 1;
  if (occupied > e.max_batch && e.running > 0) {
    const double steps_per_slot = static_cast<double>(e.remaining_output_tokens) /
                                  (static_cast<double>(e.running) * e.running);
    us += static_cast<double>(occupied - e.max_batch) * steps_per_slot * e.decode_step_us;
  }
  return us;
}

namespace {

// The engine with the least load; ties go to the one with fewer requests,
// then the lower slot.
const EngineView* least_loaded(std::span<const EngineView> engines) {
  const EngineView* best = &engines[0];
  for (const EngineView& e : engines) {
    if (e.load_tokens < best->load_tokens ||
        (e.load_tokens == best->load_tokens && e.running + e.waiting < best->running + best->waiting))
      best = &e;
  }
  return best;
}

Choice choice_of(const EngineView& e) { return Choice{e.slot, e.matched_tokens, 0}; }

class TtftPolicy final : public Policy {
 public:
  using Policy::Policy;
  PolicyKind kind() const override { return PolicyKind::kTtft; }
  Choice choose(uint32_t prompt_tokens, std::span<const EngineView> engines) override {
    const EngineView* floor = least_loaded(engines);
    const double limit = load_limit(prompt_tokens, engines);
    const EngineView* best = nullptr;
    double best_us = std::numeric_limits<double>::infinity();
    double best_cost = std::numeric_limits<double>::infinity();
    for (const EngineView& e : engines) {
      if (&e != floor && static_cast<double>(e.load_tokens + prompt_tokens) > limit) continue;
      const double us = estimated_ttft_us(e, prompt_tokens);
      const uint32_t uncached = prompt_tokens - std::min(prompt_tokens, e.matched_tokens);
      const double cost = us + options_.miss_weight * e.prefill_us_per_token * uncached;
      // Ties go to the engine that recomputes less, then to the less loaded.
      if (cost < best_cost ||
          (cost == best_cost && (e.matched_tokens > best->matched_tokens ||
                                 (e.matched_tokens == best->matched_tokens &&
                                  e.load_tokens < best->load_tokens)))) {
        best = &e;
        best_us = us;
        best_cost = cost;
      }
    }
    Choice c = choice_of(*best);
    c.estimated_ttft_us = best_us;
    return c;
  }
};

class RoundRobinPolicy final : public Policy {
 public:
  using Policy::Policy;
  PolicyKind kind() const override { return PolicyKind::kRoundRobin; }
  Choice choose(uint32_t, std::span<const EngineView> engines) override {
    // The next slot after the previous pick, so engines joining or leaving
    // do not reset the rotation.
    const EngineView* pick = &engines[0];
    for (const EngineView& e : engines)
      if (e.slot > last_slot_) {
        pick = &e;
        break;
      }
    last_slot_ = pick->slot;
    return choice_of(*pick);
  }

 private:
  int last_slot_ = -1;
};

class LeastLoadedPolicy final : public Policy {
 public:
  using Policy::Policy;
  PolicyKind kind() const override { return PolicyKind::kLeastLoaded; }
  Choice choose(uint32_t, std::span<const EngineView> engines) override {
    return choice_of(*least_loaded(engines));
  }
};

class PrefixOnlyPolicy final : public Policy {
 public:
  using Policy::Policy;
  PolicyKind kind() const override { return PolicyKind::kPrefixOnly; }
  Choice choose(uint32_t, std::span<const EngineView> engines) override {
    const EngineView* best = &engines[0];
    for (const EngineView& e : engines) {
      if (e.matched_tokens > best->matched_tokens ||
          (e.matched_tokens == best->matched_tokens && e.load_tokens < best->load_tokens))
        best = &e;
    }
    return choice_of(*best);
  }
};

}  // namespace

double Policy::load_limit(uint32_t prompt_tokens, std::span<const EngineView> engines) const {
  double total = prompt_tokens;
  for (const EngineView& o : engines) total += static_cast<double>(o.load_tokens);
  const double mean = total / static_cast<double>(engines.size());
  return options_.imbalance_bound * mean + static_cast<double>(options_.imbalance_slack_tokens);
}

bool Policy::keeps_session(const EngineView& e, uint32_t prompt_tokens,
                           std::span<const EngineView> engines) const {
  constexpr double kSessionRoom = 2.0;
  return static_cast<double>(e.load_tokens + prompt_tokens) <=
         kSessionRoom * load_limit(prompt_tokens, engines);
}

std::unique_ptr<Policy> Policy::make(PolicyKind kind, const PolicyOptions& o) {
  if (!(o.imbalance_bound >= 1.0))
    throw std::invalid_argument("imbalance_bound " + std::to_string(o.imbalance_bound) +
                                " must be >= 1");
  if (!(o.miss_weight >= 0.0 && o.miss_weight <= 100.0))
    throw std::invalid_argument("miss_weight " + std::to_string(o.miss_weight) + " is outside 0..100");
  switch (kind) {
    case PolicyKind::kTtft: return std::make_unique<TtftPolicy>(o);
    case PolicyKind::kRoundRobin: return std::make_unique<RoundRobinPolicy>(o);
    case PolicyKind::kLeastLoaded: return std::make_unique<LeastLoadedPolicy>(o);
    case PolicyKind::kPrefixOnly: return std::make_unique<PrefixOnlyPolicy>(o);
  }
  throw std::invalid_argument("unknown policy");
}

}  // namespace moelink::scheduler
