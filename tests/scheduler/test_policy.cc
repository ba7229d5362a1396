// The routing policies on hand-made engine views.
#include <gtest/gtest.h>

#include "scheduler/core/policy.h"

namespace moelink::scheduler {
namespace {

EngineView engine(int slot, uint64_t load, uint32_t matched = 0, uint64_t queued = 0) {
  EngineView v;
  v.slot = slot;
  v.load_tokens = load;
  v.matched_tokens = matched;
  v.queued_prefill_tokens = queued;
  v.max_batch = 64;
  v.prefill_us_per_token = 100;
  v.decode_step_us = 30000;
  return v;
}

TEST(Policy, TtftPrefersTheCachedPrefix) {
  auto p = Policy::make(PolicyKind::kTtft, {});
  std::vector<EngineView> e = {engine(0, 1000), engine(1, 1000, 900), engine(2, 1000)};
  const Choice c = p->choose(1000, e);
  EXPECT_EQ(c.slot, 1);
  EXPECT_EQ(c.cached_tokens, 900u);
  EXPECT_DOUBLE_EQ(c.estimated_ttft_us, 100.0 * 100);
}

TEST(Policy, TtftWeighsQueuedWorkAgainstTheCache) {
  auto p = Policy::make(PolicyKind::kTtft, {});
  // Engine 1 holds 900 of 1000 tokens but has 5,000 queued prefill tokens:
  // 5,100 tokens of work against 1,000 on engine 0.
  std::vector<EngineView> e = {engine(0, 1000), engine(1, 1000, 900, 5000)};
  EXPECT_EQ(p->choose(1000, e).slot, 0);
}

TEST(Policy, TtftKeepsABurstSharingAPrefixTogether) {
  // The first request of a burst is still queued on engine 0 (its 2,176
  // prompt tokens); the second shares its 2,048-token prefix. An idle engine
  // would start it as soon, but recompute the prefix: the miss weight
  // counts that work.
  std::vector<EngineView> e = {engine(0, 2176, 2048, 2176), engine(1, 0)};
  EXPECT_EQ(Policy::make(PolicyKind::kTtft, {})->choose(2176, e).slot, 0);
  PolicyOptions pure;
  pure.miss_weight = 0;  // the estimate alone scatters the burst
  EXPECT_EQ(Policy::make(PolicyKind::kTtft, pure)->choose(2176, e).slot, 1);
}

TEST(Policy, TtftLoadBoundOverridesTheCache) {
  PolicyOptions o;
  o.imbalance_bound = 1.5;
  o.imbalance_slack_tokens = 0;
  auto p = Policy::make(PolicyKind::kTtft, o);
  // Engine 2 holds the prefix but already holds far more than its share.
  std::vector<EngineView> e = {engine(0, 1000), engine(1, 1000), engine(2, 100000, 1000)};
  EXPECT_EQ(p->choose(1000, e).slot, 0);
}

TEST(Policy, SessionsGetTwiceTheBoundBeforeTheyMove) {
  PolicyOptions o;
  o.imbalance_bound = 1.5;
  o.imbalance_slack_tokens = 0;
  auto p = Policy::make(PolicyKind::kTtft, o);
  // Engine 3 holds the session's context. Loads 1,000 x 3 + 4,000 + the
  // 1,000-token request: mean 2,000, bound 3,000. Engine 3 would hold
  // 5,000: over the bound (a new request goes elsewhere), within twice it
  // (the session stays).
  std::vector<EngineView> e = {engine(0, 1000), engine(1, 1000), engine(2, 1000), engine(3, 4000, 3000)};
  EXPECT_NE(p->choose(1000, e).slot, 3);
  EXPECT_TRUE(p->keeps_session(e[3], 1000, e));
  // 12,000: mean 4,000, bound 6,000; 13,000 is over twice the bound.
  e[3] = engine(3, 12000, 3000);
  EXPECT_FALSE(p->keeps_session(e[3], 1000, e));
}

TEST(Policy, TtftFullBatchWaitsForASlot) {
  auto p = Policy::make(PolicyKind::kTtft, {});
  EngineView busy = engine(0, 0);
  busy.running = 64;  // full batch, 64 x 100 output tokens to go
  busy.remaining_output_tokens = 6400;
  EngineView idle = engine(1, 0);
  EXPECT_GT(estimated_ttft_us(busy, 1000), estimated_ttft_us(idle, 1000));
  std::vector<EngineView> e = {busy, idle};
  EXPECT_EQ(p->choose(1000, e).slot, 1);
}

TEST(Policy, RoundRobinTakesTurnsAcrossMembershipChanges) {
  auto p = Policy::make(PolicyKind::kRoundRobin, {});
  std::vector<EngineView> e = {engine(0, 0), engine(3, 0), engine(7, 0)};
  std::vector<int> got;
  for (int i = 0; i < 4; ++i) got.push_back(p->choose(10, e).slot);
  EXPECT_EQ(got, (std::vector<int>{0, 3, 7, 0}));
  e.erase(e.begin() + 1);  // engine 3 left: the turn goes on after 0
  EXPECT_EQ(p->choose(10, e).slot, 7);
}

TEST(Policy, LeastLoadedAndPrefixOnly) {
  std::vector<EngineView> e = {engine(0, 500), engine(1, 100), engine(2, 900, 64)};
  EXPECT_EQ(Policy::make(PolicyKind::kLeastLoaded, {})->choose(10, e).slot, 1);
  EXPECT_EQ(Policy::make(PolicyKind::kPrefixOnly, {})->choose(10, e).slot, 2);
  // No prefix anywhere: prefix-only falls back to the least loaded.
  e[2].matched_tokens = 0;
  EXPECT_EQ(Policy::make(PolicyKind::kPrefixOnly, {})->choose(10, e).slot, 1);
}

TEST(Policy, NamesAndBadOptions) {
  for (const char* n : {"ttft", "round-robin", "least-loaded", "prefix-only"})
    EXPECT_STREQ(to_string(policy_from_string(n)), n);
  try {
    policy_from_string("random");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("valid: ttft, round-robin"), std::string::npos);
  }
  PolicyOptions o;
  o.imbalance_bound = 0.5;
  EXPECT_THROW(Policy::make(PolicyKind::kTtft, o), std::invalid_argument);
}

}  // namespace
}  // namespace moelink::scheduler
