// moelink-engine-sim: a simulated inference engine for the scheduler's tests
// and benchmark. It registers with moelink-scheduler (--scheduler) like a
// real engine, and/or serves SGLang's HTTP API (--http-port) so that
// sglang-router can drive it. Times come from moelink-plan's model.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "http_front.h"
#include "moelink/version.h"
#include "scheduler/server/auth.h"
#include "sim_engine.h"

using namespace moelink::scheduler;
using namespace moelink::scheduler::sim;

namespace {

void write_stats(const std::string& path, const SimOptions& o, const CostModel& cost,
                 const SimEngine& engine) {
  nlohmann::json j;
  j["engine_id"] = o.engine_id;
  j["cost_model"] = {{"description", cost.description()},
                     {"time_scale", o.time_scale},
                     {"prefill_us_per_token", engine.prefill_us_per_token()},
                     {"decode_step_us_full_batch", engine.decode_step_us()}};
  // Unscaled (model time): tokens -> us of one prefill.
  auto& table = j["cost_model"]["prefill_table"] = nlohmann::json::array();
  for (const auto& [tokens, us] : cost.prefill_table()) table.push_back({tokens, us});
  auto& reqs = j["requests"] = nlohmann::json::array();
  for (const RequestRecord& r : engine.records())
    reqs.push_back({{"id", r.id},
                    {"prompt_tokens", r.prompt_tokens},
                    {"cached_tokens", r.cached_tokens},
                    {"output_tokens", r.output_tokens},
                    {"arrival_us", r.arrival_us},
                    {"first_token_us", r.first_token_us},
                    {"finish_us", r.finish_us}});
  auto& samples = j["load_samples"] = nlohmann::json::array();
  for (const LoadSample& s : engine.samples())
    samples.push_back({s.t_us, s.active_tokens, s.waiting_prefill_tokens, s.running, s.waiting});
  j["load_sample_fields"] = {"t_us", "active_tokens", "waiting_prefill_tokens", "running", "waiting"};
  std::ofstream out(path);
  out << j.dump() << "\n";
  if (!out) std::fprintf(stderr, "moelink-engine-sim: cannot write %s\n", path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moelink-engine-sim: a simulated inference engine for moelink-scheduler"};
  app.set_version_flag("--version", std::string("moelink-engine-sim ") + MOELINK_VERSION);
  SimOptions o;
  CostModelOptions cm;
  HttpOptions http;
  std::string scheduler = "none", token, token_file, stats_out, ready_file;
  bool print_cost = false;
  app.add_option("--scheduler", scheduler, "moelink-scheduler host:port, or none")->capture_default_str();
  app.add_option("--engine-id", o.engine_id, "unique engine name")->capture_default_str();
  app.add_option("--dp-rank", o.dp_rank, "DP rank reported at registration")->capture_default_str();
  app.add_option("--kv-blocks", o.kv_blocks, "KV cache capacity, blocks")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32))->capture_default_str();
  app.add_option("--block-size", o.block_size, "tokens per KV block")
      ->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--max-batch", o.max_batch, "running requests at most")
      ->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--max-prefill-tokens", o.max_prefill_tokens, "new tokens per prefill step")
      ->check(CLI::Range(1, 1 << 24))->capture_default_str();
  app.add_option("--time-scale", o.time_scale, "multiplies every modeled duration (0.1: 10x faster)")
      ->check(CLI::Range(1e-4, 1e4))->capture_default_str();
  app.add_flag("--events-with-tokens", o.events_with_tokens,
               "publish engine-own block hashes with token ids (vLLM style)");
  app.add_option("--engine-token", token, "the engine token the scheduler was given");
  app.add_option("--engine-token-file", token_file, "file holding the engine token");
  app.add_option("--model", cm.model, "moelink-plan model profile")->capture_default_str();
  app.add_option("--gpu", cm.gpu, "moelink-plan GPU profile")->capture_default_str();
  app.add_option("--network", cm.network, "moelink-plan network profile")->capture_default_str();
  app.add_option("--ep", cm.ep, "EP size of the modeled deployment")->capture_default_str();
  app.add_option("--tp", cm.tp, "TP size of the modeled deployment (DP = EP / TP)")->capture_default_str();
  app.add_option("--http-port", http.port, "serve SGLang's HTTP API on this port (0: off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--http-threads", http.threads, "HTTP requests streamed at once")->capture_default_str();
  app.add_option("--stream-interval", http.stream_interval, "HTTP: output tokens per streamed chunk")
      ->capture_default_str();
  app.add_option("--stats-out", stats_out, "write requests and load samples (JSON) here at exit");
  app.add_option("--ready-file", ready_file, "create this file once serving");
  app.add_flag("--print-cost-model", print_cost, "print the modeled step times and exit");
  CLI11_PARSE(app, argc, argv);

  // SIGINT/SIGTERM end the run cleanly (stats written); block them here and
  // wait for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  try {
    const CostModel cost(cm);
    if (print_cost) {
      std::printf("%s\n", cost.description().c_str());
      std::printf("prefill: %.1f us per token (marginal, 4k); 1k tokens %.0f us; 8k %.0f us\n",
                  cost.prefill_us_per_token(), cost.prefill_us(1024), cost.prefill_us(8192));
      for (int b : {1, 8, 32, 64, 128})
        std::printf("decode step, batch %3d, 4k context: %.0f us\n", b, cost.decode_step_us(b, 4096));
      return 0;
    }
    if (!token_file.empty()) {
      token = read_token_file(token_file);
    }
    if (http.port != 0 && o.address.empty())
      o.address = "http://" + http.host + ":" + std::to_string(http.port);
    SimEngine engine(o, cost);
    HttpFront front(engine, http);
    if (http.port != 0) front.start();
    if (scheduler != "none") {
      EngineClientOptions co;
      co.target = scheduler;
      co.engine_token = token;
      engine.connect(co, std::chrono::seconds(30));
    }
    engine.start();
    if (!ready_file.empty()) std::ofstream(ready_file) << "ready\n";
    int sig = 0;
    sigwait(&signals, &sig);
    // Stats first: nothing below may take long, but they are what the caller waits for.
    engine.stop();
    if (!stats_out.empty()) write_stats(stats_out, o, cost, engine);
    engine.leave();
    front.stop();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-engine-sim: error: %s\n", e.what());
    return 2;
  }
}
