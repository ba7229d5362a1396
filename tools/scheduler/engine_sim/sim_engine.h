// A simulated inference engine: requests arrive (from the scheduler's
// assignment stream or over HTTP), wait, are admitted into a batch when a
// slot and KV blocks are free, prefill (time from the cost model, less the
// cached prefix), then decode one token per step until max_new_tokens. The
// KV cache is a PrefixCache; what it stores and evicts is published as KV
// events. Time runs on the wall clock: each step sleeps its modeled duration
// (times --time-scale); a reporting thread sends each step's output to the
// scheduler while the next step runs, as a real engine's output processing
// overlaps its GPU work.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cost_model.h"
#include "moelink/scheduler/engine_client.h"
#include "prefix_cache.h"

namespace moelink::scheduler::sim {

struct SimOptions {
  std::string engine_id = "sim-0";
  uint32_t dp_rank = 0;
  uint64_t kv_blocks = 8192;
  uint32_t block_size = 16;
  uint32_t max_batch = 64;
  uint32_t max_prefill_tokens = 16384;  // per prefill step
  double time_scale = 1.0;              // modeled durations are multiplied by this
  std::string address;                  // advertised for redirects (e.g. the HTTP front)
  bool events_with_tokens = false;      // publish engine-own hashes + token ids (vLLM style)
};

// One request's output as an HTTP stream or any other local consumer sees it.
struct LocalStream {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> output;
  uint32_t cached_tokens = 0;
  bool done = false;
  double ttft_us = 0, e2e_us = 0;
};

struct RequestRecord {  // for the stats file
  std::string id;
  uint32_t prompt_tokens = 0, cached_tokens = 0, output_tokens = 0;
  int64_t arrival_us = 0, first_token_us = 0, finish_us = 0;  // wall clock (unix us)
};

struct LoadSample {
  int64_t t_us;  // wall clock
  uint64_t active_tokens, waiting_prefill_tokens;
  uint32_t running, waiting;
};

class SimEngine {
 public:
  SimEngine(const SimOptions& o, const CostModel& cost);
  ~SimEngine();

  // Connects to the scheduler (optional: without it the engine serves only
  // local requests, e.g. HTTP).
  void connect(EngineClientOptions client_options, std::chrono::milliseconds timeout);
  void start();
  void stop();  // finishes the current step, then stops
  void leave();  // tells the scheduler this engine is gone (if connected)

  // A request from a local front end (HTTP); the stream receives its output.
  void submit_local(const std::string& id, std::vector<uint32_t> prompt, uint32_t max_new,
                    std::shared_ptr<LocalStream> stream);

  std::vector<RequestRecord> records() const;
  std::vector<LoadSample> samples() const;
  double prefill_us_per_token() const;  // scaled
  double decode_step_us() const;        // at full batch, 4k context, scaled

  // The output token i of a prompt: deterministic, so a multi-turn client
  // that sends the output back sees the same tokens on every engine.
  static uint32_t output_token(uint64_t prompt_hash, uint32_t i);

 private:
  struct Request;
  void on_run(const v1::RunRequest& run);
  void on_cancel(const std::string& id);
  void on_released(const std::vector<std::string>& ids);
  std::vector<v1::HeldRequest> held() const;
  v1::EngineLoad load_locked() const;
  void loop();
  // One engine step; false when there was nothing to run.
  bool step(std::unique_lock<std::mutex>& lock);
  // One report to the scheduler: STARTED for `starting`, the output since
  // the last acknowledged report, the KV events. Holds the lock except
  // during the call; one report at a time. True when acknowledged.
  bool report_locked(std::unique_lock<std::mutex>& lock, const std::vector<Request*>& starting);
  void reporter();  // the reporting thread: sends output after each step
  void admit(std::vector<Request*>& admitted, std::vector<uint64_t>& evicted);
  void revert(Request& r);
  void drop(Request& r);
  void erase(Request* r);
  void finish(Request& r, std::vector<v1::KvEvent>& events);
  void stored_event(std::span<const uint64_t> hashes, std::span<const uint32_t> tokens,
                    size_t first_block, std::vector<v1::KvEvent>& events);
  void sample_locked(int64_t now_us);
  uint64_t engine_hash(uint64_t h) const;

  SimOptions o_;
  const CostModel& cost_;
  std::unique_ptr<EngineClient> client_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  // Assignments of a request whose previous copy here is cancelled but not
  // yet dropped; they take its place when it is.
  std::unordered_map<std::string, std::unique_ptr<Request>> reassigned_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Request*> finished_unreported_;
  std::vector<uint64_t> pending_evictions_;  // engine hashes, not yet acknowledged
  std::vector<v1::KvEvent> unacked_events_;   // stored events not yet acknowledged
  std::condition_variable report_cv_;
  bool reporting_ = false, report_due_ = false;
  std::thread reporter_;
  PrefixCache cache_;
  std::vector<RequestRecord> records_;
  std::vector<LoadSample> samples_;
  int64_t next_sample_us_ = 0;
  std::thread thread_;
};

}  // namespace moelink::scheduler::sim
