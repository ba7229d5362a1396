// moelink-scheduler-bench: how fast the scheduler decides, saturated, in one
// thread: SchedulerCore with N engines whose prefix indexes hold the trace's
// shared prefixes, fed requests (hash the prompt, match every engine, apply
// the policy, account, build the messages) as fast as it takes them, while
// the engines' reports finish earlier requests so load stays steady. Prints
// JSON: decisions per second and the decision latency percentiles.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <deque>
#include <nlohmann/json.hpp>
#include <random>

#include "moelink/scheduler/block_hash.h"
#include "moelink/version.h"
#include "scheduler/core/scheduler_core.h"

using namespace moelink::scheduler;

namespace {

template <class Msg>
class NullSink final : public Sink<Msg> {
 public:
  bool send(Msg) override { return true; }
  void close(const grpc::Status&) override {}
};

// Remembers which engine the last request went to.
class AcceptedSink final : public Sink<v1::GenerateEvent> {
 public:
  bool send(v1::GenerateEvent ev) override {
    if (ev.has_accepted()) engine = std::stoi(ev.accepted().engine_id().substr(1));
    return true;
  }
  void close(const grpc::Status&) override {}
  int engine = -1;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moelink-scheduler-bench: saturated routing decisions of the scheduler core"};
  app.set_version_flag("--version", std::string("moelink-scheduler-bench ") + MOELINK_VERSION);
  int engines = 16, prefixes = 64, prefix_tokens = 2048, suffix_tokens = 256, requests = 200000;
  int in_flight = 1024;
  std::string policy = "ttft";
  uint32_t block_size = 16;
  app.add_option("--engines", engines, "simulated engines")->check(CLI::Range(1, kMaxEngines))->capture_default_str();
  app.add_option("--prefixes", prefixes, "distinct shared prefixes (system prompts)")->capture_default_str();
  app.add_option("--prefix-tokens", prefix_tokens, "tokens of each shared prefix")->capture_default_str();
  app.add_option("--suffix-tokens", suffix_tokens, "unique tokens after the prefix")->capture_default_str();
  app.add_option("--requests", requests, "decisions to time")->capture_default_str();
  app.add_option("--in-flight", in_flight, "requests outstanding at once (engines finish the oldest)")
      ->capture_default_str();
  app.add_option("--policy", policy, "ttft | round-robin | least-loaded | prefix-only")->capture_default_str();
  app.add_option("--block-size", block_size, "tokens per KV block")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  SchedulerOptions o;
  o.policy = policy;
  o.block_size = block_size;
  auto now = Clock::now();
  SchedulerCore core(o, nullptr, {}, now);
  std::mt19937 rng(12345);
  std::vector<std::vector<uint32_t>> shared(prefixes);
  for (auto& p : shared) {
    p.resize(prefix_tokens);
    for (auto& t : p) t = rng() % 100000;
  }
  struct Eng {
    std::string id;
    uint64_t inc = 0, seq = 0;
  };
  std::vector<Eng> es(engines);
  for (int i = 0; i < engines; ++i) {
    v1::RegisterRequest reg;
    reg.mutable_engine()->set_engine_id("e" + std::to_string(i));
    reg.mutable_engine()->set_kv_capacity_blocks(1 << 20);
    reg.mutable_engine()->set_block_size(block_size);
    reg.mutable_engine()->set_max_batch(256);
    v1::RegisterResponse resp;
    core.register_engine(reg, &resp, now);
    es[i] = {reg.engine().engine_id(), resp.incarnation(), 0};
    v1::ReceiveAssignmentsRequest ra;
    ra.set_engine_id(es[i].id);
    ra.set_incarnation(es[i].inc);
    core.attach_engine(ra, std::make_shared<NullSink<v1::Assignment>>(), now);
    // Each engine holds a quarter of the shared prefixes.
    v1::EngineReport r;
    r.set_engine_id(es[i].id);
    r.set_incarnation(es[i].inc);
    r.set_seq(++es[i].seq);
    for (int p = i % 4; p < prefixes; p += 4) {
      auto* st = r.add_kv_events()->mutable_stored();
      for (uint64_t h : prompt_block_hashes(shared[p], block_size)) st->add_block_hashes(h);
    }
    v1::ReportResponse rr;
    core.report(r, &rr, now);
  }
  // Prompts made up front so the timing is the scheduler's, not the generator's.
  const int pool = 4096;
  std::vector<v1::GenerateRequest> reqs(pool);
  for (auto& q : reqs) {
    const auto& p = shared[rng() % prefixes];
    q.mutable_prompt_tokens()->Add(p.begin(), p.end());
    for (int t = 0; t < suffix_tokens; ++t) q.add_prompt_tokens(rng() % 100000);
    q.mutable_sampling()->set_max_new_tokens(128);
  }
  auto sink = std::make_shared<AcceptedSink>();
  std::deque<std::pair<std::string, int>> outstanding;  // request id, engine
  std::vector<double> lat;
  lat.reserve(requests);
  v1::Stats stats;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_tick = now;
  for (int i = 0; i < requests; ++i) {
    v1::GenerateRequest q = reqs[i % pool];
    q.set_request_id("q" + std::to_string(i));
    // The server's clock: real time, with the core's tick every 10 ms.
    now = Clock::now();
    if (now - last_tick > std::chrono::milliseconds(10)) {
      core.tick(now);
      last_tick = now;
    }
    const auto a = std::chrono::steady_clock::now();
    core.submit(std::move(q), sink, now);
    lat.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
    outstanding.push_back({"q" + std::to_string(i), sink->engine});
    if (static_cast<int>(outstanding.size()) > in_flight) {
      // The oldest starts and finishes (its engine reports it, as it would).
      const auto [id, engine] = outstanding.front();
      outstanding.pop_front();
      Eng& e = es[engine];
      v1::EngineReport r;
      r.set_engine_id(e.id);
      r.set_incarnation(e.inc);
      r.set_seq(++e.seq);
      for (auto phase : {v1::RequestProgress::STARTED, v1::RequestProgress::FINISHED}) {
        auto* p = r.add_progress();
        p->set_request_id(id);
        p->set_phase(phase);
      }
      v1::ReportResponse rr;
      core.report(r, &rr, now);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  core.stats(&stats);
  double submit_secs = 0;
  for (double l : lat) submit_secs += l * 1e-6;
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) { return lat[static_cast<size_t>(p * (lat.size() - 1))]; };
  nlohmann::json j = {
      {"engines", engines},
      {"policy", policy},
      {"prompt_tokens", prefix_tokens + suffix_tokens},
      {"requests", requests},
      // One thread: submits (validate, hash, match, decide, account, build
      // the messages) back to back, and with the reports that finish them.
      {"decisions_per_s", requests / submit_secs},
      {"decisions_per_s_with_reports", requests / secs},
      {"submit_us", {{"p50", pct(0.5)}, {"p99", pct(0.99)}, {"max", lat.back()}}},
      // The core's own clock: hashing + match + policy (its stats window).
      {"decision_us",
       {{"p50", stats.decision_p50_us()}, {"p99", stats.decision_p99_us()}, {"max", stats.decision_max_us()}}},
  };
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
