// SchedulerCore without the network: routing, request lifecycle, failures,
// recovery and every bad input, with recording sinks and a hand-driven clock.
#include <gtest/gtest.h>

#include <map>

#include "moelink/scheduler/block_hash.h"
#include "scheduler/core/scheduler_core.h"
#include "scheduler_test_util.h"

namespace moelink::scheduler {
namespace {

using grpc::Status;
using grpc::StatusCode;
using testing::expect_status;
using testing::generate_request;
using testing::random_tokens;
using testing::RecordingSink;
using testing::TempDir;
using AssignmentSink = RecordingSink<v1::Assignment>;
using EventSink = RecordingSink<v1::GenerateEvent>;
using P = v1::RequestProgress;

std::string engine_name(int i) {
  std::string s = "e";  // (not "e" + to_string: GCC 12 warns falsely, -Wrestrict)
  s += std::to_string(i);
  return s;
}

struct TestEngine {
  std::string id;
  uint64_t incarnation = 0;
  uint64_t seq = 0;
  std::shared_ptr<AssignmentSink> sink;
  // Request ids of the RunRequests received so far.
  std::vector<std::string> runs() const {
    std::vector<std::string> out;
    for (const auto& a : sink->messages())
      if (a.has_run()) out.push_back(a.run().request_id());
    return out;
  }
};

class CoreTest : public ::testing::Test {
 protected:
  void make(SchedulerOptions o = {}, RequestLog* log = nullptr,
            std::vector<RequestLog::LiveRequest> recovered = {}) {
    options = o;
    core = std::make_unique<SchedulerCore>(o, log, std::move(recovered), now);
  }
  void SetUp() override { make(); }

  v1::RegisterRequest registration(const std::string& id, uint64_t blocks = 4096, uint32_t batch = 8,
                                   const std::string& address = "") {
    v1::RegisterRequest r;
    v1::EngineInfo* i = r.mutable_engine();
    i->set_engine_id(id);
    i->set_kv_capacity_blocks(blocks);
    i->set_block_size(options.block_size);
    i->set_max_batch(batch);
    i->set_address(address);
    i->set_prefill_us_per_token(100);
    i->set_decode_step_us(20000);
    return r;
  }

  TestEngine add(const std::string& id, uint64_t blocks = 4096, const std::string& address = "",
                 std::vector<v1::HeldRequest> held = {}, v1::EngineRole role = v1::ROLE_MIXED) {
    v1::RegisterRequest req = registration(id, blocks, 8, address);
    req.mutable_engine()->set_role(role);
    if (role == v1::ROLE_DECODE) req.mutable_engine()->set_handoff_address("127.0.0.1:7" + id.substr(1));
    for (auto& h : held) *req.add_held() = h;
    v1::RegisterResponse resp;
    Status s = core->register_engine(req, &resp, now);
    EXPECT_TRUE(s.ok()) << s.error_message();
    TestEngine e{id, resp.incarnation(), 0, std::make_shared<AssignmentSink>()};
    released = {resp.released().begin(), resp.released().end()};
    v1::ReceiveAssignmentsRequest ra;
    ra.set_engine_id(id);
    ra.set_incarnation(e.incarnation);
    s = core->attach_engine(ra, e.sink, now);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return e;
  }

  Status report(TestEngine& e, std::vector<P> progress = {}, std::vector<v1::KvEvent> events = {},
                v1::ReportResponse* out = nullptr) {
    v1::EngineReport r;
    r.set_engine_id(e.id);
    r.set_incarnation(e.incarnation);
    r.set_seq(++e.seq);
    for (auto& p : progress) *r.add_progress() = p;
    for (auto& ev : events) *r.add_kv_events() = ev;
    v1::ReportResponse resp;
    Status s = core->report(r, out ? out : &resp, now);
    if (!s.ok()) --e.seq;
    return s;
  }

  std::shared_ptr<EventSink> submit(const v1::GenerateRequest& req, Status* status = nullptr) {
    auto sink = std::make_shared<EventSink>();
    Status s = core->submit(req, sink, now);
    if (status) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return sink;
  }

  static P progress(const std::string& id, P::Phase phase, std::vector<uint32_t> tokens = {},
                    uint32_t offset = 0, uint32_t cached = 0) {
    P p;
    p.set_request_id(id);
    p.set_phase(phase);
    p.mutable_new_tokens()->Add(tokens.begin(), tokens.end());
    p.set_token_offset(offset);
    p.set_cached_tokens(cached);
    return p;
  }

  static v1::KvEvent stored(const std::vector<uint64_t>& hashes, const uint64_t* parent = nullptr,
                            const std::vector<uint32_t>& tokens = {}) {
    v1::KvEvent ev;
    auto* st = ev.mutable_stored();
    st->mutable_block_hashes()->Add(hashes.begin(), hashes.end());
    if (parent) st->set_parent_block_hash(*parent);
    st->mutable_token_ids()->Add(tokens.begin(), tokens.end());
    return ev;
  }

  // The engine an accepted request went to (from its Accepted event).
  static std::string engine_of(const EventSink& s) {
    for (const auto& ev : s.messages())
      if (ev.has_accepted()) return ev.accepted().engine_id();
    return "";
  }
  static std::string id_of(const EventSink& s) {
    for (const auto& ev : s.messages())
      if (ev.has_accepted()) return ev.accepted().request_id();
    return "";
  }
  static std::vector<uint32_t> tokens_of(const EventSink& s) {
    std::vector<uint32_t> out;
    for (const auto& ev : s.messages())
      if (ev.has_tokens()) {
        EXPECT_EQ(ev.tokens().offset(), out.size());
        out.insert(out.end(), ev.tokens().token_ids().begin(), ev.tokens().token_ids().end());
      }
    return out;
  }

  void advance(int ms) {
    now += std::chrono::milliseconds(ms);
    core->tick(now);
  }

  v1::Stats stats() const {
    v1::Stats s;
    core->stats(&s);
    return s;
  }

  SchedulerOptions options;
  Clock::time_point now = Clock::now();
  std::unique_ptr<SchedulerCore> core;
  std::vector<std::string> released;
  std::mt19937 rng{std::random_device{}()};
};

// ------------------------------------------------------------------ routing

TEST_F(CoreTest, RoutesToTheEngineHoldingTheSharedPrefix) {
  std::vector<TestEngine> e;
  for (int i = 0; i < 4; ++i) e.push_back(add(engine_name(i)));
  const auto prefix = random_tokens(256, rng);  // 16 blocks
  ASSERT_TRUE(report(e[2], {}, {stored(prompt_block_hashes(prefix, 16))}).ok());
  auto prompt = prefix;
  for (uint32_t t : random_tokens(40, rng)) prompt.push_back(t);
  auto s = submit(generate_request(prompt, 8));
  EXPECT_EQ(engine_of(*s), "e2");
  EXPECT_EQ(s->messages()[0].accepted().expected_cached_tokens(), 256u);
  ASSERT_EQ(e[2].runs().size(), 1u);
  EXPECT_EQ(e[2].sink->messages()[0].run().expected_cached_tokens(), 256u);
  EXPECT_EQ(e[2].sink->messages()[0].run().prompt_tokens_size(), 296);
}

TEST_F(CoreTest, EngineHashesWithTokenIdsAreMapped) {
  TestEngine a = add("a"), b = add("b");
  const auto prefix = random_tokens(64, rng);  // 4 blocks, the engine's own hashes 101..104
  const uint64_t parent = 102;
  ASSERT_TRUE(report(b, {}, {stored({101, 102}, nullptr, {prefix.begin(), prefix.begin() + 32})}).ok());
  ASSERT_TRUE(report(b, {}, {stored({103, 104}, &parent, {prefix.begin() + 32, prefix.end()})}).ok());
  auto s = submit(generate_request(prefix, 4));
  EXPECT_EQ(engine_of(*s), "b");
  EXPECT_EQ(s->messages()[0].accepted().expected_cached_tokens(), 64u);
  EXPECT_EQ(stats().engines(1).indexed_blocks(), 4u);
  // Removing by the engine's hash removes the mapped block.
  v1::KvEvent rm;
  rm.mutable_removed()->add_block_hashes(101);
  ASSERT_TRUE(report(b, {}, {rm}).ok());
  EXPECT_EQ(stats().engines(1).indexed_blocks(), 3u);
}

// Events are hints: a stored event the scheduler cannot place (its parent
// unknown, removed or cleared earlier in the same report, or stored without
// token ids) is dropped and counted; the rest of the report, the request's
// progress included, is applied.
TEST_F(CoreTest, StoredEventsWithAnUnknownParentAreDroppedNotRefused) {
  TestEngine e = add("e");
  auto s = submit(generate_request(random_tokens(40, rng), 4, "r1"));
  ASSERT_EQ(e.runs().size(), 1u);
  const auto tokens = random_tokens(16, rng);
  const uint64_t unknown = 0xabcdef, plain = 7, removed_parent = 11, cleared_parent = 12;
  v1::KvEvent rm, clear;
  rm.mutable_removed()->add_block_hashes(removed_parent);
  clear.mutable_cleared();
  const std::vector<v1::KvEvent> events = {
      stored({1}, &unknown, tokens),                // never stored
      stored({plain}),                              // stored without tokens: not in the map
      stored({2}, &plain, tokens),
      stored({removed_parent}, nullptr, tokens),    // stored, then removed before its child
      rm,
      stored({3}, &removed_parent, tokens),
      stored({cleared_parent}, nullptr, tokens),
      clear,
      stored({4}, &cleared_parent, tokens),
      stored({5}, nullptr, tokens),                 // a root block: placed
  };
  ASSERT_TRUE(report(e, {progress("r1", P::STARTED)}, events).ok());
  EXPECT_EQ(stats().engines(0).dropped_kv_events(), 4u);
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 1u);  // only block 5 (the clear took `plain`)
  ASSERT_TRUE(report(e, {progress("r1", P::FINISHED, {9, 9, 9, 9})}).ok());
  EXPECT_EQ(stats().finished(), 1u);
  EXPECT_TRUE(s->status().ok());
}

// The same rule for events without token ids (their hashes are moelink
// block hashes): the parent must be a block the engine stored, still holds
// and reported since it registered, or the event is dropped and counted. An
// engine that sends a child before its parent loses the child.
TEST_F(CoreTest, StoredEventsWithoutTokensNeedAKnownParentToo) {
  TestEngine e = add("e");
  const uint64_t never = 0xabcdef, gone = 3, one = 1, two = 2, ten = 10;
  v1::KvEvent rm;
  rm.mutable_removed()->add_block_hashes(gone);
  const std::vector<v1::KvEvent> events = {
      stored({one, two}),            // a root chain: placed
      stored({4}, &never),           // parent never stored
      stored({11}, &ten),            // the child before its parent
      stored({ten}, &two),           // placed
      stored({gone}, &one),          // placed, then removed
      rm,
      stored({5}, &gone),            // parent removed
  };
  ASSERT_TRUE(report(e, {}, events).ok());
  EXPECT_EQ(stats().engines(0).dropped_kv_events(), 3u);
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 3u);  // 1, 2, 10
  // What was dropped is not matched: a prompt of blocks 1, 2, 10, 11 finds
  // three of them on e.
  const auto prompt = random_tokens(16 * 4, rng);
  std::vector<uint64_t> h = prompt_block_hashes(prompt, 16);
  ASSERT_TRUE(report(e, {}, {stored({h[0], h[1]}), stored({h[3]}, &h[2])}).ok());
  EXPECT_EQ(stats().engines(0).dropped_kv_events(), 4u);
  auto s = submit(generate_request(prompt, 4));
  EXPECT_EQ(s->messages()[0].accepted().expected_cached_tokens(), 32u);
}

TEST_F(CoreTest, RecentRoutingsCountUntilEventsArrive) {
  options.provisional_ttl_ms = 1000;
  make(options);
  std::vector<TestEngine> e;
  for (int i = 0; i < 4; ++i) e.push_back(add(engine_name(i)));
  const auto prefix = random_tokens(512, rng);
  auto first = submit(generate_request(prefix, 4));
  const std::string home = engine_of(*first);
  // No events yet: the second request follows the first.
  auto with_suffix = prefix;
  with_suffix.push_back(7);
  EXPECT_EQ(engine_of(*submit(generate_request(with_suffix, 4))), home);
  // Once the provisional entries expire with no event, the prefix is no longer credited.
  advance(1500);
  auto third = submit(generate_request(with_suffix, 4));
  EXPECT_EQ(third->messages()[0].accepted().expected_cached_tokens(), 0u);
}

// An engine's part of the prefix index holds at most the kv_capacity_blocks
// it declared: what a report stores beyond that is refused (newest first) and
// counted, so an engine that never reports removals cannot grow the
// scheduler's memory. Removals later in the same report make room first.
TEST_F(CoreTest, AnEnginesIndexIsBoundedByItsDeclaredCapacity) {
  TestEngine e = add("small", 8);
  std::vector<uint64_t> chain;
  for (uint64_t h = 1; h <= 20; ++h) chain.push_back(h);
  ASSERT_TRUE(report(e, {}, {stored(chain)}).ok());
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 8u);
  EXPECT_EQ(stats().engines(0).refused_kv_blocks(), 12u);
  // Blocks 9..20 were refused: a child of 20 has an unknown parent.
  const uint64_t twenty = 20, eight = 8;
  ASSERT_TRUE(report(e, {}, {stored({21}, &twenty)}).ok());
  EXPECT_EQ(stats().engines(0).dropped_kv_events(), 1u);
  // Full: a child of 8 is refused too, and a second report cannot add more.
  ASSERT_TRUE(report(e, {}, {stored({21}, &eight), stored({100, 101})}).ok());
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 8u);
  EXPECT_EQ(stats().engines(0).refused_kv_blocks(), 15u);
  // Stores before the removals that make room for them, in one report (as
  // moelink-engine-sim sends them): all kept.
  v1::KvEvent rm;
  for (uint64_t h : {5, 6, 7, 8}) rm.mutable_removed()->add_block_hashes(h);
  ASSERT_TRUE(report(e, {}, {stored({200, 201, 202, 203}), rm}).ok());
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 8u);
  EXPECT_EQ(stats().engines(0).refused_kv_blocks(), 15u);
  // With token ids the engine's hashes are mapped; refused blocks leave no
  // mapping behind (a child of one is dropped), and the map is bounded too.
  rm.mutable_removed()->Clear();
  for (uint64_t h : {1, 2, 3, 4}) rm.mutable_removed()->add_block_hashes(h);
  const auto tokens = random_tokens(16 * 6, rng);
  const uint64_t last = 306;
  ASSERT_TRUE(report(e, {}, {rm, stored({301, 302, 303, 304, 305, 306}, nullptr, tokens)}).ok());
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 8u);
  EXPECT_EQ(stats().engines(0).refused_kv_blocks(), 17u);
  ASSERT_TRUE(report(e, {}, {stored({307}, &last, random_tokens(16, rng))}).ok());
  EXPECT_EQ(stats().engines(0).dropped_kv_events(), 2u);
  // The first four token blocks were kept: the prompt's first 64 tokens match.
  auto s = submit(generate_request(tokens, 4));
  EXPECT_EQ(s->messages()[0].accepted().expected_cached_tokens(), 64u);
  // 20,000 blocks in one report from an engine of 1,024: 1,024 indexed.
  TestEngine big = add("big", 1024);
  std::vector<uint64_t> many(20000);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 1000000 + i;
  ASSERT_TRUE(report(big, {}, {stored(many)}).ok());
  EXPECT_EQ(stats().engines(1).indexed_blocks(), 1024u);
  EXPECT_EQ(stats().engines(1).refused_kv_blocks(), 20000u - 1024u);
}

TEST_F(CoreTest, SpreadsRequestsWhenNothingIsShared) {
  std::vector<TestEngine> e;
  for (int i = 0; i < 4; ++i) e.push_back(add(engine_name(i)));
  std::map<std::string, int> count;
  for (int i = 0; i < 40; ++i) ++count[engine_of(*submit(generate_request(random_tokens(300, rng), 16)))];
  ASSERT_EQ(count.size(), 4u);
  for (const auto& [id, n] : count) EXPECT_EQ(n, 10) << id;
}

TEST_F(CoreTest, LoadBoundKeepsAHotPrefixFromPilingUp) {
  options.imbalance_bound = 1.5;
  options.imbalance_slack_tokens = 0;
  make(options);
  std::vector<TestEngine> e;
  for (int i = 0; i < 4; ++i) e.push_back(add(engine_name(i)));
  const auto prefix = random_tokens(512, rng);
  std::map<std::string, int> count;
  for (int i = 0; i < 40; ++i) {
    auto p = prefix;
    p.push_back(static_cast<uint32_t>(i));
    ++count[engine_of(*submit(generate_request(p, 16)))];
  }
  // Without the bound all 40 would go to one engine.
  int most = 0;
  for (const auto& [id, n] : count) most = std::max(most, n);
  EXPECT_LE(most, 16);
  EXPECT_GE(count.size(), 3u);
}

TEST_F(CoreTest, StickySessionsStayOnTheirEngine) {
  options.policy = "round-robin";
  make(options);
  for (int i = 0; i < 4; ++i) add(engine_name(i));
  const std::string home = engine_of(*submit(generate_request(random_tokens(64, rng), 4, "", "chat-1")));
  for (int turn = 0; turn < 5; ++turn)
    EXPECT_EQ(engine_of(*submit(generate_request(random_tokens(64, rng), 4, "", "chat-1"))), home);
  EXPECT_NE(engine_of(*submit(generate_request(random_tokens(64, rng), 4))), home);
}

TEST_F(CoreTest, WaitsForAnEngineThenTimesOut) {
  options.queue_timeout_ms = 1000;
  make(options);
  auto early = submit(generate_request(random_tokens(20, rng), 4));
  EXPECT_TRUE(early->messages().empty());  // pending: no engine yet
  TestEngine e = add("late");
  EXPECT_EQ(engine_of(*early), "late");
  v1::LeaveRequest leave;
  leave.set_engine_id("late");
  leave.set_incarnation(e.incarnation);
  v1::LeaveResponse left;
  ASSERT_TRUE(core->leave(leave, &left, now).ok());
  auto orphan = submit(generate_request(random_tokens(20, rng), 4));
  advance(500);
  EXPECT_FALSE(orphan->closed());
  advance(700);
  ASSERT_TRUE(orphan->closed());
  expect_status(orphan->status(), StatusCode::RESOURCE_EXHAUSTED, {"no engine", "1000 ms"});
}

// ------------------------------------------------------------------ lifecycle

TEST_F(CoreTest, StreamsTokensAndFinishes) {
  TestEngine e = add("e");
  auto req = generate_request(random_tokens(40, rng), 10, "req-1");
  req.set_stream_interval(4);
  auto s = submit(req);
  ASSERT_EQ(e.runs(), std::vector<std::string>{"req-1"});
  ASSERT_TRUE(report(e, {progress("req-1", P::STARTED, {}, 0, 16)}).ok());
  ASSERT_TRUE(report(e, {progress("req-1", P::RUNNING, {1}, 0)}).ok());        // first token: at once
  ASSERT_TRUE(report(e, {progress("req-1", P::RUNNING, {2, 3}, 1)}).ok());     // held (interval 4)
  EXPECT_EQ(s->messages().size(), 2u);
  ASSERT_TRUE(report(e, {progress("req-1", P::RUNNING, {2, 3, 4, 5}, 1)}).ok());  // a retry: 2, 3 known
  ASSERT_TRUE(report(e, {progress("req-1", P::FINISHED, {6, 7, 8, 9, 10}, 5)}).ok());
  ASSERT_TRUE(s->closed());
  EXPECT_TRUE(s->status().ok());
  EXPECT_EQ(tokens_of(*s), (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  const auto msgs = s->messages();
  const auto& fin = msgs.back();
  ASSERT_TRUE(fin.has_finished());
  EXPECT_EQ(fin.finished().output_tokens(), 10u);
  EXPECT_EQ(fin.finished().cached_tokens(), 16u);
  EXPECT_EQ(fin.finished().engine_id(), "e");
  EXPECT_EQ(stats().finished(), 1u);
  EXPECT_EQ(stats().engines(0).outstanding(), 0u);
}

// Resume of a finished request ends with the same Finished event as the
// request's own stream did (the engine that ran it, the prompt tokens it found
// cached), though the request no longer belongs to an engine.
TEST_F(CoreTest, ResumeOfAFinishedRequestNamesItsEngineAndCachedTokens) {
  TestEngine a = add("a"), b = add("b");
  auto s = submit(generate_request(random_tokens(40, rng), 3, "done"));
  TestEngine& ran = engine_of(*s) == "a" ? a : b;
  ASSERT_TRUE(report(ran, {progress("done", P::STARTED, {}, 0, 32)}).ok());
  ASSERT_TRUE(report(ran, {progress("done", P::FINISHED, {7, 8, 9}, 0)}).ok());
  ASSERT_TRUE(s->status().ok());
  const v1::Finished generated = s->messages().back().finished();
  EXPECT_EQ(generated.engine_id(), ran.id);
  EXPECT_EQ(generated.cached_tokens(), 32u);
  for (uint32_t from : {0u, 3u}) {
    v1::ResumeRequest rr;
    rr.set_request_id("done");
    rr.set_from_token(from);
    auto resumed = std::make_shared<EventSink>();
    ASSERT_TRUE(core->resume(rr, resumed).ok());
    ASSERT_TRUE(resumed->status().ok());
    const auto msgs = resumed->messages();
    ASSERT_FALSE(msgs.empty());
    ASSERT_TRUE(msgs.back().has_finished());
    const v1::Finished& f = msgs.back().finished();
    EXPECT_EQ(f.engine_id(), ran.id) << "from_token " << from;
    EXPECT_EQ(f.cached_tokens(), 32u) << "from_token " << from;
    EXPECT_EQ(f.output_tokens(), 3u);
    EXPECT_EQ(f.finish_reason(), generated.finish_reason());
    EXPECT_EQ(tokens_of(*resumed).size(), 3u - from);
  }
}

TEST_F(CoreTest, ProgressOfARequestNoLongerTheEnginesIsRevoked) {
  TestEngine e = add("e");
  auto s = submit(generate_request(random_tokens(40, rng), 10, "gone"));
  ASSERT_TRUE(core->cancel("gone").ok());
  expect_status(s->status(), StatusCode::CANCELLED, {"gone"});
  ASSERT_TRUE(e.sink->messages().back().has_cancel());
  v1::ReportResponse resp;
  ASSERT_TRUE(report(e, {progress("gone", P::STARTED)}, {}, &resp).ok());
  ASSERT_EQ(resp.revoked_size(), 1);
  EXPECT_EQ(resp.revoked(0), "gone");
}

TEST_F(CoreTest, RejectedRequestsMoveOnAndFailWhenNobodyTakesThem) {
  options.queue_timeout_ms = 100;
  make(options);
  TestEngine a = add("a"), b = add("b");
  auto s = submit(generate_request(random_tokens(40, rng), 4, "r"));
  TestEngine& first = engine_of(*s) == "a" ? a : b;
  TestEngine& second = engine_of(*s) == "a" ? b : a;
  ASSERT_TRUE(report(first, {progress("r", P::REJECTED)}).ok());
  EXPECT_EQ(second.runs(), std::vector<std::string>{"r"});
  ASSERT_TRUE(report(second, {progress("r", P::REJECTED)}).ok());
  advance(200);
  expect_status(s->status(), StatusCode::RESOURCE_EXHAUSTED, {"no engine"});
  EXPECT_EQ(stats().rerouted(), 2u);
}

TEST_F(CoreTest, ClientGoneCancelsAtTheEngine) {
  TestEngine e = add("e");
  auto s = submit(generate_request(random_tokens(40, rng), 4, "r"));
  core->client_gone("r", s.get());
  advance(1);
  ASSERT_TRUE(e.sink->messages().back().has_cancel());
  EXPECT_EQ(e.sink->messages().back().cancel().request_id(), "r");
  EXPECT_EQ(stats().requests_in_flight(), 0u);
}

TEST_F(CoreTest, RedirectNamesAnEngineWithAnAddress) {
  Status st;
  auto none = submit([&] {
    auto r = generate_request(random_tokens(40, rng), 4);
    r.set_redirect(true);
    return r;
  }());
  expect_status(none->status(), StatusCode::UNAVAILABLE, {"address"});
  add("no-address");
  add("web", 4096, "http://10.0.0.7:30000");
  auto r = generate_request(random_tokens(40, rng), 4);
  r.set_redirect(true);
  for (int i = 0; i < 3; ++i) {
    auto s = submit(r);
    ASSERT_EQ(s->messages().size(), 1u);
    ASSERT_TRUE(s->messages()[0].has_redirect());
    EXPECT_EQ(s->messages()[0].redirect().address(), "http://10.0.0.7:30000");
    EXPECT_TRUE(s->status().ok());
  }
}

// ------------------------------------------------------------------ failures

TEST_F(CoreTest, SilentEngineIsDrainedQueuedMovesStartedFails) {
  options.heartbeat_interval_ms = 100;
  options.heartbeat_timeout_ms = 300;
  make(options);
  TestEngine a = add("a"), b = add("b");
  std::vector<std::shared_ptr<EventSink>> on_a;
  std::vector<std::string> a_ids;
  while (on_a.size() < 2) {
    auto s = submit(generate_request(random_tokens(100, rng), 8));
    if (engine_of(*s) == "a") {
      on_a.push_back(s);
      a_ids.push_back(id_of(*s));
    }
  }
  ASSERT_TRUE(report(a, {progress(a_ids[0], P::STARTED), progress(a_ids[0], P::RUNNING, {5}, 0)}).ok());
  // b keeps reporting, a goes silent.
  for (int t = 0; t < 4; ++t) {
    advance(100);
    ASSERT_TRUE(report(b).ok());
  }
  expect_status(on_a[0]->status(), StatusCode::UNAVAILABLE, {"'a'", "after request", "started"});
  EXPECT_FALSE(on_a[1]->closed());  // queued: re-routed, still running
  const auto b_runs = b.runs();
  EXPECT_NE(std::find(b_runs.begin(), b_runs.end(), a_ids[1]), b_runs.end());
  EXPECT_TRUE(a.sink->closed());
  expect_status(a.sink->status(), StatusCode::UNAVAILABLE, {"heartbeat"});
  // The fenced incarnation's reports are refused; it registers again, empty.
  expect_status(report(a), StatusCode::FAILED_PRECONDITION, {"drained", "register again"});
  TestEngine a2 = add("a");
  EXPECT_NE(a2.incarnation, a.incarnation);
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 0u);
  EXPECT_TRUE(stats().engines(0).alive());
  expect_status(report(a), StatusCode::FAILED_PRECONDITION, {"incarnation", "not the current"});
}

TEST_F(CoreTest, RegisteringAgainKeepsHeldRequestsAndMovesTheRest) {
  TestEngine a = add("a"), b = add("b");
  std::vector<std::shared_ptr<EventSink>> on_a;
  std::vector<std::string> ids;
  while (on_a.size() < 3) {
    auto s = submit(generate_request(random_tokens(100, rng), 8));
    if (engine_of(*s) == "a") {
      on_a.push_back(s);
      ids.push_back(id_of(*s));
    }
  }
  ASSERT_TRUE(report(a, {progress(ids[0], P::STARTED), progress(ids[0], P::RUNNING, {1, 2}, 0)}).ok());
  ASSERT_TRUE(report(a, {progress(ids[1], P::STARTED)}).ok());
  // The assignment stream broke; a registers again holding ids[0] (3 tokens
  // by now) but not ids[1] (lost after start) nor ids[2] (never received),
  // and something the scheduler never gave it.
  v1::HeldRequest h0, stray;
  h0.set_request_id(ids[0]);
  h0.set_started(true);
  for (uint32_t t : {1u, 2u, 3u}) h0.add_output_tokens(t);
  stray.set_request_id("stray");
  TestEngine a2 = add("a", 4096, "", {h0, stray});
  EXPECT_EQ(released, std::vector<std::string>{"stray"});
  EXPECT_EQ(tokens_of(*on_a[0]), (std::vector<uint32_t>{1, 2, 3}));
  expect_status(on_a[1]->status(), StatusCode::UNAVAILABLE, {"registered again without request"});
  const auto b_runs = b.runs();
  EXPECT_NE(std::find(b_runs.begin(), b_runs.end(), ids[2]), b_runs.end());
  ASSERT_TRUE(report(a2, {progress(ids[0], P::FINISHED, {4}, 3)}).ok());
  EXPECT_EQ(tokens_of(*on_a[0]), (std::vector<uint32_t>{1, 2, 3, 4}));
  EXPECT_TRUE(on_a[0]->status().ok());
}

TEST_F(CoreTest, LeaveWithAndWithoutDrain) {
  TestEngine a = add("a");
  auto s = submit(generate_request(random_tokens(40, rng), 4, "r1"));
  v1::LeaveRequest l;
  l.set_engine_id("a");
  l.set_incarnation(a.incarnation);
  l.set_drain(true);
  v1::LeaveResponse resp;
  ASSERT_TRUE(core->leave(l, &resp, now).ok());
  auto s2 = submit(generate_request(random_tokens(40, rng), 4, "r2"));
  EXPECT_TRUE(s2->messages().empty());  // nothing new goes to a draining engine
  ASSERT_TRUE(report(a, {progress("r1", P::FINISHED, {9}, 0)}).ok());  // it finishes what it held
  EXPECT_TRUE(s->status().ok());
  TestEngine b = add("b");
  EXPECT_EQ(engine_of(*s2), "b");
  ASSERT_TRUE(report(b, {progress("r2", P::STARTED)}).ok());
  l.set_engine_id("b");
  l.set_incarnation(b.incarnation);
  l.set_drain(false);
  ASSERT_TRUE(core->leave(l, &resp, now).ok());
  EXPECT_TRUE(b.sink->closed());
  expect_status(s2->status(), StatusCode::UNAVAILABLE, {"'b'", "left"});
  expect_status(report(b), StatusCode::FAILED_PRECONDITION, {"left"});
}

// ------------------------------------------------------------------ P/D disaggregation

TEST_F(CoreTest, DisaggregatedRequestsPrefillOnePlaceAndDecodeAnother) {
  TestEngine p = add("p1", 4096, "", {}, v1::ROLE_PREFILL);
  // No decode engine yet: the prefill engine runs a request whole.
  auto alone = submit(generate_request(random_tokens(40, rng), 2, "alone"));
  ASSERT_EQ(p.runs(), std::vector<std::string>{"alone"});
  EXPECT_TRUE(p.sink->messages().back().run().decode_engine_id().empty());
  TestEngine d = add("d1", 4096, "", {}, v1::ROLE_DECODE);
  TestEngine d2 = add("d2", 4096, "", {}, v1::ROLE_DECODE);
  auto s = submit(generate_request(random_tokens(40, rng), 4, "pd"));
  ASSERT_EQ(p.runs(), (std::vector<std::string>{"alone", "pd"}));  // never to a decode engine directly
  EXPECT_TRUE(d.runs().empty() && d2.runs().empty());
  const v1::RunRequest run = p.sink->messages().back().run();
  TestEngine& dec = run.decode_engine_id() == "d1" ? d : d2;
  ASSERT_EQ(run.decode_engine_id(), dec.id);
  EXPECT_EQ(run.decode_handoff_address(), "127.0.0.1:7" + dec.id.substr(1));
  ASSERT_TRUE(report(p, {progress("pd", P::STARTED, {}, 0, 16)}).ok());
  P h = progress("pd", P::HANDED_OFF, {5}, 0);
  h.set_handed_to(dec.id);
  ASSERT_TRUE(report(p, {h}).ok());
  // From now the decode engine's reports count, the prefill engine's are revoked.
  v1::ReportResponse resp;
  ASSERT_TRUE(report(p, {progress("pd", P::RUNNING, {9}, 1)}, {}, &resp).ok());
  ASSERT_EQ(resp.revoked_size(), 1);
  ASSERT_TRUE(report(dec, {progress("pd", P::RUNNING, {6, 7}, 1)}).ok());
  ASSERT_TRUE(report(dec, {progress("pd", P::FINISHED, {8}, 3)}).ok());
  ASSERT_TRUE(s->closed());
  EXPECT_TRUE(s->status().ok()) << s->status().error_message();
  EXPECT_EQ(tokens_of(*s), (std::vector<uint32_t>{5, 6, 7, 8}));
  EXPECT_EQ(s->messages().back().finished().engine_id(), dec.id);
  const v1::Stats st = stats();
  EXPECT_EQ(st.handed_off(), 1u);
  for (const auto& e : st.engines()) {
    if (e.engine_id() == "p1") {
      EXPECT_EQ(e.outstanding(), 1u);  // "alone" still runs there
    } else if (e.engine_id() == dec.id) {
      EXPECT_EQ(e.outstanding(), 0u);
      EXPECT_EQ(e.role(), v1::ROLE_DECODE);
    }
  }
  // A decode engine lost after the hand-off fails the request, naming it.
  auto s2 = submit(generate_request(random_tokens(40, rng), 4, "pd2"));
  const std::string to = p.sink->messages().back().run().decode_engine_id();
  ASSERT_FALSE(to.empty());
  P h2 = progress("pd2", P::HANDED_OFF, {5}, 0);
  h2.set_handed_to(to);
  ASSERT_TRUE(report(p, {progress("pd2", P::STARTED), h2}).ok());
  v1::LeaveRequest l;
  l.set_engine_id(to);
  l.set_incarnation(to == d.id ? d.incarnation : d2.incarnation);
  v1::LeaveResponse lr;
  ASSERT_TRUE(core->leave(l, &lr, now).ok());
  const std::string quoted = "'" + to + "'";
  expect_status(s2->status(), StatusCode::UNAVAILABLE, {quoted.c_str(), "pd2"});
  // A hand-off to an engine that is not a live decode engine fails the request.
  auto s3 = submit(generate_request(random_tokens(40, rng), 4, "pd3"));
  P h3 = progress("pd3", P::HANDED_OFF, {5}, 0);
  h3.set_handed_to("p1");
  ASSERT_TRUE(report(p, {progress("pd3", P::STARTED), h3}).ok());
  expect_status(s3->status(), StatusCode::UNAVAILABLE, {"'p1'", "not a live decode engine"});
  // HANDED_OFF without handed_to is refused whole.
  auto s4 = submit(generate_request(random_tokens(40, rng), 4, "pd4"));
  expect_status(report(p, {progress("pd4", P::HANDED_OFF, {5}, 0)}), StatusCode::INVALID_ARGUMENT,
                {"handed_to is empty"});
  // A decode engine must say where its hand-off service is.
  v1::RegisterRequest bad = registration("d9");
  bad.mutable_engine()->set_role(v1::ROLE_DECODE);
  v1::RegisterResponse rr;
  expect_status(core->register_engine(bad, &rr, now), StatusCode::INVALID_ARGUMENT, {"handoff_address"});
}

TEST_F(CoreTest, RecoversLoggedRequestsAfterARestart) {
  TempDir dir;
  const std::string path = dir.file("log");
  options.recovery_grace_ms = 500;
  std::vector<std::string> ids;
  {
    std::vector<RequestLog::LiveRequest> live;
    RequestLog log(path, &live);
    make(options, &log);
    TestEngine a = add("a");
    for (int i = 0; i < 4; ++i) submit(generate_request(random_tokens(40, rng), 8, "q" + std::to_string(i)));
    log.sync();  // durable -> routed
    core->tick(now);
    ASSERT_EQ(a.runs().size(), 4u);
    ASSERT_TRUE(report(a, {progress("q0", P::STARTED), progress("q0", P::RUNNING, {1, 2}, 0),
                           progress("q1", P::STARTED), progress("q3", P::STARTED),
                           progress("q3", P::FINISHED, {7}, 0)})
                    .ok());
    log.sync();
    core.reset();  // the scheduler dies
  }
  std::vector<RequestLog::LiveRequest> live;
  RequestLog log(path, &live);
  ASSERT_EQ(live.size(), 3u);  // q3 finished
  make(options, &log, std::move(live));
  // The client resumes q0 at once, past the output the restarted scheduler
  // knows (none yet): the stream waits for the engine.
  auto c0 = std::make_shared<EventSink>();
  v1::ResumeRequest rr;
  rr.set_request_id("q0");
  rr.set_from_token(2);
  ASSERT_TRUE(core->resume(rr, c0).ok());
  EXPECT_TRUE(c0->messages().empty());
  // The engine comes back holding q0 (3 tokens now) and q2 (queued); q1
  // started on an engine that never returns.
  v1::HeldRequest h0, h2;
  h0.set_request_id("q0");
  h0.set_started(true);
  for (uint32_t t : {1u, 2u, 3u}) h0.add_output_tokens(t);
  h2.set_request_id("q2");
  TestEngine a = add("a", 4096, "", {h0, h2});
  EXPECT_TRUE(released.empty());
  ASSERT_TRUE(report(a, {progress("q0", P::FINISHED, {4}, 3)}).ok());
  std::vector<uint32_t> streamed;
  for (const auto& m : c0->messages())
    if (m.has_tokens()) {
      EXPECT_EQ(m.tokens().offset(), 2 + streamed.size());
      streamed.insert(streamed.end(), m.tokens().token_ids().begin(), m.tokens().token_ids().end());
    }
  EXPECT_EQ(streamed, (std::vector<uint32_t>{3, 4}));
  EXPECT_TRUE(c0->closed());
  EXPECT_TRUE(c0->status().ok());
  advance(600);  // grace over: q1 fails (it had started), q2 stays with a
  // Resuming a failed request answers its status, whatever from_token.
  rr.set_request_id("q1");
  for (uint32_t from : {0u, 5u}) {
    rr.set_from_token(from);
    expect_status(core->resume(rr, std::make_shared<EventSink>()), StatusCode::UNAVAILABLE,
                  {"q1", "did not return"});
  }
  EXPECT_EQ(stats().engines(0).outstanding(), 1u);  // q2
}

TEST_F(CoreTest, UnclaimedLoggedRequestsAreRoutedAfterTheGrace) {
  TempDir dir;
  const std::string path = dir.file("log");
  options.recovery_grace_ms = 300;
  {
    std::vector<RequestLog::LiveRequest> live;
    RequestLog log(path, &live);
    make(options, &log);
    submit(generate_request(random_tokens(40, rng), 8, "w"));
    log.sync();
    core.reset();
  }
  std::vector<RequestLog::LiveRequest> live;
  RequestLog log(path, &live);
  make(options, &log, std::move(live));
  TestEngine a = add("a");  // holds nothing
  advance(100);
  EXPECT_TRUE(a.runs().empty());
  advance(300);
  EXPECT_EQ(a.runs(), std::vector<std::string>{"w"});
}

// ------------------------------------------------------------------ bad input

TEST_F(CoreTest, BadEngineInput) {
  v1::RegisterResponse resp;
  auto reg = registration("e1");
  reg.mutable_engine()->set_block_size(32);
  expect_status(core->register_engine(reg, &resp, now), StatusCode::FAILED_PRECONDITION,
                {"block_size 32", "'e1'", "block size 16"});
  reg = registration("bad id!");
  expect_status(core->register_engine(reg, &resp, now), StatusCode::INVALID_ARGUMENT,
                {"engine.engine_id", "bad id!", "[A-Za-z0-9._:-]"});
  reg = registration("e1", 0);
  expect_status(core->register_engine(reg, &resp, now), StatusCode::INVALID_ARGUMENT,
                {"kv_capacity_blocks 0"});
  reg = registration("e1", 8, 0);
  expect_status(core->register_engine(reg, &resp, now), StatusCode::INVALID_ARGUMENT, {"max_batch 0"});

  TestEngine ghost{"ghost", 1, 0, nullptr};
  expect_status(report(ghost), StatusCode::NOT_FOUND, {"engine_id 'ghost'", "not registered"});
  v1::ReceiveAssignmentsRequest ra;
  ra.set_engine_id("ghost");
  expect_status(core->attach_engine(ra, std::make_shared<AssignmentSink>(), now), StatusCode::NOT_FOUND,
                {"'ghost'"});

  TestEngine e = add("e1");
  ASSERT_TRUE(report(e).ok());
  TestEngine replay = e;
  replay.seq = 0;  // seq 1 again
  expect_status(report(replay), StatusCode::ALREADY_EXISTS,
                {"seq 1", "last accepted 1", "out of order or repeated"});
  TestEngine stale = e;
  stale.incarnation += 99;
  expect_status(report(stale), StatusCode::FAILED_PRECONDITION, {"incarnation", "register again"});

  expect_status(report(e, {}, {stored({1, 2}, nullptr, {1, 2, 3})}), StatusCode::INVALID_ARGUMENT,
                {"kv_events[0].stored.token_ids has 3 tokens", "need 32"});
  expect_status(report(e, {}, {stored({}, nullptr)}), StatusCode::INVALID_ARGUMENT,
                {"block_hashes is empty"});
  expect_status(report(e, {}, {v1::KvEvent{}}), StatusCode::INVALID_ARGUMENT, {"kv_events[0] has no event"});
  expect_status(report(e, {progress("", P::RUNNING)}), StatusCode::INVALID_ARGUMENT,
                {"progress[0].request_id is empty"});
  expect_status(report(e, {progress("x", P::PHASE_UNSPECIFIED)}), StatusCode::INVALID_ARGUMENT,
                {"progress[0].phase 0"});
  // A refused report changes nothing and does not use up its seq.
  EXPECT_EQ(stats().engines(0).indexed_blocks(), 0u);
  ASSERT_TRUE(report(e).ok());
}

TEST_F(CoreTest, BadClientInput) {
  add("e", 64);  // 64 blocks x 16 = 1,024 tokens of KV cache
  Status s;
  submit(generate_request({}, 4), &s);
  expect_status(s, StatusCode::INVALID_ARGUMENT, {"prompt_tokens is empty"});
  submit(generate_request(std::vector<uint32_t>(options.max_prompt_tokens + 1, 1), 4), &s);
  expect_status(s, StatusCode::OUT_OF_RANGE, {"131073 tokens", "limit is 131072", "--max-prompt-tokens"});
  submit(generate_request({1, 2}, 0), &s);
  expect_status(s, StatusCode::OUT_OF_RANGE, {"sampling.max_new_tokens 0", "1..32768"});
  submit(generate_request({1, 2}, 40000), &s);
  expect_status(s, StatusCode::OUT_OF_RANGE, {"max_new_tokens 40000"});
  submit(generate_request({1, 2}, 4, "has space"), &s);
  expect_status(s, StatusCode::INVALID_ARGUMENT, {"request_id 'has space'"});
  submit(generate_request(std::vector<uint32_t>(1000, 1), 100), &s);
  expect_status(s, StatusCode::OUT_OF_RANGE, {"exceed the largest engine's KV cache (1024 tokens)"});
  auto r = generate_request({1, 2}, 4);
  r.set_stream_interval(5000);
  submit(r, &s);
  expect_status(s, StatusCode::INVALID_ARGUMENT, {"stream_interval 5000"});
  r = generate_request({1, 2}, 4);
  r.set_session_id(std::string(300, 's'));
  submit(r, &s);
  expect_status(s, StatusCode::INVALID_ARGUMENT, {"session_id", "at most 256"});
  submit(generate_request({1, 2}, 4, "dup"), &s);
  ASSERT_TRUE(s.ok());
  submit(generate_request({1, 2}, 4, "dup"), &s);
  expect_status(s, StatusCode::ALREADY_EXISTS, {"'dup'"});
  v1::ResumeRequest rr;
  rr.set_request_id("nope");
  expect_status(core->resume(rr, std::make_shared<EventSink>()), StatusCode::NOT_FOUND, {"'nope'"});
  rr.set_request_id("dup");
  rr.set_from_token(5);
  expect_status(core->resume(rr, std::make_shared<EventSink>()), StatusCode::OUT_OF_RANGE,
                {"from_token 5", "0 output tokens"});
  expect_status(core->cancel("nope"), StatusCode::NOT_FOUND, {"'nope'"});
}

TEST_F(CoreTest, EngineTableFullThenSlotsAreReused) {
  options.heartbeat_interval_ms = 10;
  options.heartbeat_timeout_ms = 20;
  make(options);
  for (int i = 0; i < kMaxEngines; ++i) add(engine_name(i));
  v1::RegisterResponse resp;
  expect_status(core->register_engine(registration("one-too-many"), &resp, now),
                StatusCode::RESOURCE_EXHAUSTED, {"engine table is full", "256"});
  advance(30);  // every engine silent: all drained, their slots free
  EXPECT_TRUE(core->register_engine(registration("one-too-many"), &resp, now).ok());
}

TEST(SchedulerOptions, ValidateNamesTheOption) {
  SchedulerOptions o;
  o.validate();
  o.heartbeat_timeout_ms = o.heartbeat_interval_ms;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o = {};
  o.policy = "fastest";
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o = {};
  o.tls_cert = "cert.pem";
  try {
    o.validate();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tls_key"), std::string::npos);
  }
}

}  // namespace
}  // namespace moelink::scheduler
