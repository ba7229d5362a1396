// The scheduler's state and every decision it makes, without the network:
// the engine table, the prefix index, the requests and their lifecycle
// (pending -> queued on an engine -> running -> done), heartbeats, fencing,
// recovery from the request log. server/ wires it to gRPC; tests and the
// decision benchmark drive it directly.
//
// Thread safety: every public method takes one mutex. Messages to clients
// and engines go out through Sinks while it is held (sink.h: they only queue).
#pragma once
#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "moelink/scheduler/options.h"
#include "moelink/scheduler/v1/scheduler.pb.h"
#include "scheduler/core/latency_recorder.h"
#include "scheduler/core/policy.h"
#include "scheduler/core/prefix_index.h"
#include "scheduler/core/request_log.h"
#include "scheduler/core/sink.h"

namespace moelink::scheduler {

using ClientSink = Sink<v1::GenerateEvent>;
using EngineSink = Sink<v1::Assignment>;


class SchedulerCore {
 public:
  // `log` may be null (no durability); `recovered` are the live requests the
  // log held at startup.
  SchedulerCore(const SchedulerOptions& options, RequestLog* log,
                std::vector<RequestLog::LiveRequest> recovered, Clock::time_point now);
  ~SchedulerCore();

  // ---- engines (EngineGateway)
  grpc::Status register_engine(const v1::RegisterRequest& req, v1::RegisterResponse* resp,
                               Clock::time_point now);
  grpc::Status attach_engine(const v1::ReceiveAssignmentsRequest& req,
                             std::shared_ptr<EngineSink> sink, Clock::time_point now);
  // The engine's assignment stream ended (`sink` is the one attached). Like
  // client_gone, safe from any thread; handled at the next tick.
  void engine_stream_closed(const std::string& engine_id, const EngineSink* sink);
  grpc::Status report(const v1::EngineReport& report, v1::ReportResponse* resp,
                      Clock::time_point now);
  grpc::Status leave(const v1::LeaveRequest& req, v1::LeaveResponse* resp, Clock::time_point now);

  // ---- clients (Frontend)
  // Validates and accepts a request; the sink then receives its events.
  grpc::Status submit(v1::GenerateRequest req, std::shared_ptr<ClientSink> sink,
                      Clock::time_point now);
  grpc::Status resume(const v1::ResumeRequest& req, std::shared_ptr<ClientSink> sink);
  grpc::Status cancel(const std::string& request_id);
  // A client's stream went away (safe to call from any thread, never blocks
  // on the core): its request is cancelled at the next tick.
  void client_gone(const std::string& request_id, const ClientSink* sink);
  void stats(v1::Stats* out) const;

  // Heartbeat deadlines, provisional index entries, queue timeouts,
  // retention, recovery grace. Call every few milliseconds.
  void tick(Clock::time_point now);

  const SchedulerOptions& options() const { return options_; }
  // A fresh request id ("r-" and 16 hex digits).
  static std::string new_request_id();

 private:
  enum class EngineState { kRegistered, kLive, kDraining, kDead, kLeft };
  enum class RequestState { kLogging, kRecovered, kPending, kQueued, kRunning, kDone };
  struct Request;
  struct Engine {
    int slot = -1;
    std::string id;
    v1::EngineInfo info;
    uint64_t incarnation = 0;
    EngineState state = EngineState::kDead;
    Clock::time_point last_heard{};
    uint64_t last_seq = 0;
    v1::EngineLoad reported;
    std::shared_ptr<EngineSink> sink;
    // Engine block hash -> moelink block hash, for events that carried tokens.
    absl::flat_hash_map<uint64_t, uint64_t> hash_map;
    uint64_t dropped_kv_events = 0;  // stored events with an unknown parent
    uint64_t refused_kv_blocks = 0;  // stored blocks beyond kv_capacity_blocks
    // The scheduler's own accounting of the requests it routed here.
    absl::flat_hash_set<Request*> requests;
    uint64_t load_tokens = 0, queued_prefill_tokens = 0, remaining_output_tokens = 0;
    uint32_t queued = 0, running = 0;
    // Redirected requests since the engine's last report (it reports them then).
    uint64_t redirect_tokens = 0, redirect_prefill_tokens = 0;
    uint32_t redirect_requests = 0;
    uint64_t assigned_total = 0;
    bool routable() const { return state == EngineState::kLive && sink != nullptr; }
  };
  struct Request {
    std::string id;
    v1::GenerateRequest req;
    std::vector<uint64_t> hashes;
    double hash_us = 0;  // time spent hashing the prompt, counted in the first decision
    RequestState state = RequestState::kPending;
    int slot = -1;
    uint64_t incarnation = 0;
    uint32_t expected_cached = 0, cached = 0;
    uint64_t uncached_estimate = 0;
    std::vector<uint32_t> output;
    std::shared_ptr<ClientSink> client;
    uint32_t forwarded = 0;  // output tokens sent to the client
    bool started_before_restart = false;
    std::vector<int> refused_by;  // slots that rejected it
    Clock::time_point pending_since{}, done_at{};
    std::string finish_reason;
    grpc::Status final_status;
    // The engine that ran it, kept past finish() (which detaches it from the
    // engine) so that a Resume's Finished names it as the Generate stream's did.
    std::string finished_on;
  };
  struct Session {
    int slot = -1;
    Clock::time_point last_used{};
    std::list<std::string>::iterator lru;
  };

  Engine* find_engine(const std::string& id);
  grpc::Status check_current(const std::string& engine_id, uint64_t incarnation, Engine** out);
  grpc::Status validate_report(const v1::EngineReport& r) const;  // its shape only
  // What a report added, in order: a block newly in the engine's confirmed
  // set and/or a new engine-hash mapping to it.
  struct Added {
    uint64_t hash;         // moelink block hash
    uint64_t engine_hash;  // with `mapped`
    bool indexed, mapped;
  };
  void apply_events(Engine& e, const v1::EngineReport& r);
  // Takes back the newest of `added` while the engine's index or hash map
  // holds more than its kv_capacity_blocks.
  void bound_to_capacity(Engine& e, std::vector<Added>& added);
  // False when the request is no longer this engine's.
  bool apply_progress(Engine& e, const v1::RequestProgress& p, Clock::time_point now);
  int free_slot();

  void accept_durable(const std::string& id, Clock::time_point now);
  void route(Request& r, Clock::time_point now);
  bool try_route(Request& r, Clock::time_point now);
  void route_redirect(Request& r, std::shared_ptr<ClientSink> sink, Clock::time_point now);
  void build_views(const Request& r, bool need_address);
  // Provisional index marks and the sticky session for a routing decision.
  void note_routing(const Request& r, const Engine& e, const Choice& c, Clock::time_point now);
  void assign(Request& r, Engine& e, const Choice& c, Clock::time_point now);
  void mark_started(Request& r, Engine& e, uint32_t cached_tokens);
  // P/D: the decode engine a prefill engine hands `r` to (null: none live),
  // and the move of a started request to it (HANDED_OFF).
  const Engine* decode_engine_for() const;
  void hand_off(Request& r, Engine& from, const std::string& to, Clock::time_point now);
  void detach(Request& r);
  void add_output(Request& r, const v1::RequestProgress& p);
  void forward(Request& r, bool flush);
  // The Finished event of a request that finished OK; one builder for the
  // Generate stream and every later Resume, so that they say the same.
  static v1::GenerateEvent finished_event(const Request& r);
  void finish(Request& r, const grpc::Status& status, const std::string& reason,
              Clock::time_point now);
  void reroute(Request& r, Clock::time_point now);
  // The engine is gone: queued requests re-routed, started ones failed.
  void drop_engine(Engine& e, EngineState new_state, const grpc::Status& stream_status,
                   const std::string& why, Clock::time_point now);
  void route_pending(Clock::time_point now);
  void remember_session(const std::string& session, int slot, Clock::time_point now);
  EngineView view_of(const Engine& e) const;

  const SchedulerOptions options_;
  RequestLog* log_;
  PolicyKind policy_kind_;
  std::unique_ptr<Policy> policy_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Engine>> engines_;  // index = slot
  std::unordered_map<std::string, int> engine_slots_;
  uint64_t next_incarnation_;
  PrefixIndex index_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::deque<std::string> pending_;       // requests waiting for an engine, in order
  std::deque<std::string> done_order_;    // finished requests, for retention
  std::unordered_map<std::string, Session> sessions_;
  std::list<std::string> session_lru_;    // front = least recently used
  Clock::time_point recovery_deadline_{};
  bool recovering_ = false;

  // Scratch space for route(), reused to keep decisions allocation-free.
  std::vector<EngineView> views_;
  std::vector<uint32_t> matched_;

  // Counters for stats(). A decision's time is the prompt's hashing, the
  // prefix match and the policy: what choosing an engine costs, without the
  // network writes that follow.
  uint64_t accepted_ = 0, finished_ = 0, failed_ = 0, rerouted_ = 0, decisions_ = 0;
  uint64_t ignored_progress_ = 0, handed_off_ = 0;
  LatencyRecorder decision_us_;

  // client_gone() and engine_stream_closed() notifications, drained by tick()
  // (they arrive from gRPC callbacks that may run inside a send or close).
  std::mutex gone_mu_;
  std::vector<std::pair<std::string, const ClientSink*>> gone_clients_;
  std::vector<std::pair<std::string, const EngineSink*>> gone_engine_streams_;
};

}  // namespace moelink::scheduler
