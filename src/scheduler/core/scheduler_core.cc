#include "scheduler/core/scheduler_core.h"

#include <algorithm>
#include <tuple>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>

#include "moelink/scheduler/block_hash.h"
#include "scheduler/core/validate.h"

namespace moelink::scheduler {
namespace {

using grpc::Status;
using grpc::StatusCode;

double us_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

Clock::duration ms(uint32_t v) { return std::chrono::milliseconds(v); }

}  // namespace


SchedulerCore::SchedulerCore(const SchedulerOptions& options, RequestLog* log,
                             std::vector<RequestLog::LiveRequest> recovered,
                             Clock::time_point now)
    : options_(options),
      log_(log),
      policy_kind_(policy_from_string(options.policy)),
      policy_(Policy::make(policy_kind_,
                           PolicyOptions{options.imbalance_bound, options.imbalance_slack_tokens,
                                         options.miss_weight})) {
  options_.validate();
  // Incarnations stay unique across scheduler restarts: start from the wall clock.
  next_incarnation_ = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count());
  for (auto& live : recovered) {
    auto r = std::make_unique<Request>();
    r->id = live.request.request_id();
    r->req = std::move(live.request);
    prompt_block_hashes(tokens_of(r->req.prompt_tokens()), options_.block_size, r->hashes);
    r->state = RequestState::kRecovered;
    r->started_before_restart = live.started;
    r->pending_since = now;
    ++accepted_;
    requests_.emplace(r->id, std::move(r));
  }
  if (!requests_.empty()) {
    recovering_ = true;
    recovery_deadline_ =
        now + ms(options_.recovery_grace_ms ? options_.recovery_grace_ms : options_.heartbeat_timeout_ms);
  }
}

SchedulerCore::~SchedulerCore() = default;

std::string SchedulerCore::new_request_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[24];
  std::snprintf(buf, sizeof(buf), "r-%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// ------------------------------------------------------------------ engines

SchedulerCore::Engine* SchedulerCore::find_engine(const std::string& id) {
  auto it = engine_slots_.find(id);
  return it == engine_slots_.end() ? nullptr : engines_[it->second].get();
}

int SchedulerCore::free_slot() {
  if (engines_.size() < static_cast<size_t>(kMaxEngines)) {
    engines_.push_back(std::make_unique<Engine>());
    engines_.back()->slot = static_cast<int>(engines_.size()) - 1;
    return engines_.back()->slot;
  }
  // Reuse the slot of an engine that is gone and owes nothing.
  for (auto& e : engines_) {
    if ((e->state == EngineState::kDead || e->state == EngineState::kLeft) && e->requests.empty()) {
      engine_slots_.erase(e->id);
      const int slot = e->slot;
      e = std::make_unique<Engine>();
      e->slot = slot;
      return slot;
    }
  }
  return -1;
}

Status SchedulerCore::register_engine(const v1::RegisterRequest& req, v1::RegisterResponse* resp,
                                      Clock::time_point now) {
  const v1::EngineInfo& info = req.engine();
  if (Status s = validate_engine_info(info, options_.block_size); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  Engine* e = find_engine(info.engine_id());
  if (e == nullptr) {
    const int slot = free_slot();
    if (slot < 0)
      return Status(StatusCode::RESOURCE_EXHAUSTED,
                    "engine table is full: " + std::to_string(kMaxEngines) +
                        " engines are registered and alive or owe requests");
    e = engines_[slot].get();
    e->id = info.engine_id();
    engine_slots_[e->id] = slot;
  }
  // Fence the previous incarnation: what it held and is not held now is
  // re-routed (not started; never back to this engine's old stream) or
  // failed (started).
  if (e->sink) e->sink->close(Status(StatusCode::ABORTED, "superseded by a new registration"));
  e->sink.reset();
  if (e->state == EngineState::kLive) e->state = EngineState::kRegistered;
  absl::flat_hash_set<std::string> held;
  for (const auto& h : req.held()) held.insert(h.request_id());
  std::vector<Request*> previous(e->requests.begin(), e->requests.end());
  for (Request* r : previous) {
    if (held.contains(r->id)) continue;
    if (r->state == RequestState::kQueued) {
      reroute(*r, now);
    } else {
      finish(*r,
             Status(StatusCode::UNAVAILABLE, "engine '" + e->id +
                                                 "' registered again without request " + r->id +
                                                 ", which had started there"),
             "engine_lost", now);
    }
  }
  index_.clear(e->slot);
  e->hash_map.clear();
  e->info = info;
  if (e->info.prefill_us_per_token() <= 0)
    e->info.set_prefill_us_per_token(options_.default_prefill_us_per_token);
  if (e->info.decode_step_us() <= 0) e->info.set_decode_step_us(options_.default_decode_step_us);
  e->incarnation = ++next_incarnation_;
  e->state = EngineState::kRegistered;
  e->last_heard = now;
  e->last_seq = 0;
  e->reported = v1::EngineLoad{};
  e->redirect_tokens = e->redirect_prefill_tokens = 0;
  e->redirect_requests = 0;

  // Adopt what the engine still holds, if the scheduler gave it (or, after a
  // restart, logged it and gave it to nobody yet).
  for (const auto& h : req.held()) {
    auto it = requests_.find(h.request_id());
    Request* r = it == requests_.end() ? nullptr : it->second.get();
    const bool ours = r != nullptr && r->slot == e->slot &&
                      (r->state == RequestState::kQueued || r->state == RequestState::kRunning);
    const bool recovered = r != nullptr && r->state == RequestState::kRecovered;
    if (!ours && !recovered) {
      resp->add_released(h.request_id());
      continue;
    }
    if (recovered) {
      Choice c;
      c.slot = e->slot;
      assign(*r, *e, c, now);  // sends nothing: no stream attached yet, no client
    }
    r->incarnation = e->incarnation;
    if (h.started() && r->state == RequestState::kQueued) mark_started(*r, *e, r->cached);
    v1::RequestProgress p;
    *p.mutable_new_tokens() = h.output_tokens();
    add_output(*r, p);
  }
  resp->set_incarnation(e->incarnation);
  resp->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  resp->set_heartbeat_timeout_ms(options_.heartbeat_timeout_ms);
  return Status::OK;
}

Status SchedulerCore::check_current(const std::string& engine_id, uint64_t incarnation,
                                    Engine** out) {
  Engine* e = find_engine(engine_id);
  if (e == nullptr)
    return Status(StatusCode::NOT_FOUND, "engine_id '" + engine_id + "' is not registered");
  if (incarnation != e->incarnation)
    return Status(StatusCode::FAILED_PRECONDITION,
                  "incarnation " + std::to_string(incarnation) + " of engine '" + engine_id +
                      "' is not the current one (" + std::to_string(e->incarnation) +
                      "); register again");
  if (e->state == EngineState::kDead || e->state == EngineState::kLeft)
    return Status(StatusCode::FAILED_PRECONDITION,
                  "engine '" + engine_id + "' was " +
                      (e->state == EngineState::kDead ? "drained after missing heartbeats"
                                                      : "removed (it left)") +
                      "; register again");
  *out = e;
  return Status::OK;
}

Status SchedulerCore::attach_engine(const v1::ReceiveAssignmentsRequest& req,
                                    std::shared_ptr<EngineSink> sink, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine* e = nullptr;
  if (Status s = check_current(req.engine_id(), req.incarnation(), &e); !s.ok()) return s;
  if (e->sink) e->sink->close(Status(StatusCode::ABORTED, "another assignment stream replaced this one"));
  e->sink = std::move(sink);
  if (e->state == EngineState::kRegistered) e->state = EngineState::kLive;
  e->last_heard = now;
  route_pending(now);
  return Status::OK;
}

void SchedulerCore::engine_stream_closed(const std::string& engine_id, const EngineSink* sink) {
  std::lock_guard<std::mutex> lock(gone_mu_);
  gone_engine_streams_.emplace_back(engine_id, sink);
}

Status SchedulerCore::validate_report(const v1::EngineReport& r) const {
  // Only the report's shape is checked here, so that a refused report changes
  // nothing. Whether a stored event's parent is known is decided while
  // applying, in order (events are hints: one the scheduler cannot place is
  // dropped and counted, never a reason to refuse the engine's progress).
  for (int i = 0; i < r.kv_events_size(); ++i) {
    const v1::KvEvent& ev = r.kv_events(i);
    const std::string where = "kv_events[" + std::to_string(i) + "]";
    switch (ev.kind_case()) {
      case v1::KvEvent::kStored: {
        const v1::BlocksStored& st = ev.stored();
        if (st.block_hashes_size() == 0)
          return Status(StatusCode::INVALID_ARGUMENT, where + ".stored.block_hashes is empty");
        if (st.token_ids_size() != 0) {
          const int64_t want = static_cast<int64_t>(st.block_hashes_size()) * options_.block_size;
          if (st.token_ids_size() != want)
            return Status(StatusCode::INVALID_ARGUMENT,
                          where + ".stored.token_ids has " + std::to_string(st.token_ids_size()) +
                              " tokens; " + std::to_string(st.block_hashes_size()) +
                              " blocks of block_size " + std::to_string(options_.block_size) +
                              " need " + std::to_string(want));
        }
        break;
      }
      case v1::KvEvent::kRemoved:
      case v1::KvEvent::kCleared:
        break;
      default:
        return Status(StatusCode::INVALID_ARGUMENT, where + " has no event (stored, removed or cleared)");
    }
  }
  for (int i = 0; i < r.progress_size(); ++i) {
    const v1::RequestProgress& p = r.progress(i);
    if (p.request_id().empty())
      return Status(StatusCode::INVALID_ARGUMENT, "progress[" + std::to_string(i) + "].request_id is empty");
    if (p.phase() == v1::RequestProgress::PHASE_UNSPECIFIED || !v1::RequestProgress::Phase_IsValid(p.phase()))
      return Status(StatusCode::INVALID_ARGUMENT,
                    "progress[" + std::to_string(i) + "].phase " + std::to_string(p.phase()) +
                        " is not one of STARTED, RUNNING, FINISHED, FAILED, REJECTED, HANDED_OFF");
    if (p.phase() == v1::RequestProgress::HANDED_OFF && p.handed_to().empty())
      return Status(StatusCode::INVALID_ARGUMENT,
                    "progress[" + std::to_string(i) + "].handed_to is empty; HANDED_OFF names the decode engine");
  }
  return Status::OK;
}

void SchedulerCore::apply_events(Engine& e, const v1::EngineReport& r) {
  // Not a member reused across reports: one huge report would keep its size.
  std::vector<Added> added;
  for (const v1::KvEvent& ev : r.kv_events()) {
    switch (ev.kind_case()) {
      case v1::KvEvent::kStored: {
        const v1::BlocksStored& st = ev.stored();
        if (st.token_ids_size() == 0) {
          // The hashes are moelink block hashes, so the parent is too: it must
          // be a block of this engine's in the index (the same rule as below;
          // indexing a child whose parent is unknown would credit the engine
          // with a prefix it may not hold).
          if (st.has_parent_block_hash() && !index_.holds(e.slot, st.parent_block_hash())) {
            ++e.dropped_kv_events;
            break;
          }
          for (uint64_t h : st.block_hashes())
            if (index_.store(e.slot, h)) added.push_back({h, 0, true, false});
          break;
        }
        // The engine's hashes are its own: compute ours from the tokens.
        uint64_t parent = kRootBlockHash;
        if (st.has_parent_block_hash()) {
          // Unknown: never stored, already removed, or stored before this
          // incarnation registered (registration forgets the engine's blocks).
          auto it = e.hash_map.find(st.parent_block_hash());
          if (it == e.hash_map.end()) {
            ++e.dropped_kv_events;
            break;
          }
          parent = it->second;
        }
        const uint32_t bs = options_.block_size;
        for (int b = 0; b < st.block_hashes_size(); ++b) {
          parent = block_hash(parent, std::span<const uint32_t>(st.token_ids().data() + b * bs, bs));
          const bool mapped = e.hash_map.insert_or_assign(st.block_hashes(b), parent).second;
          const bool indexed = index_.store(e.slot, parent);
          if (mapped || indexed) added.push_back({parent, st.block_hashes(b), indexed, mapped});
        }
        break;
      }
      case v1::KvEvent::kRemoved:
        for (uint64_t h : ev.removed().block_hashes()) {
          auto it = e.hash_map.find(h);
          if (it != e.hash_map.end()) {
            index_.remove(e.slot, it->second);
            e.hash_map.erase(it);
          } else {
            index_.remove(e.slot, h);
          }
        }
        break;
      case v1::KvEvent::kCleared:
        index_.clear(e.slot);
        e.hash_map.clear();
        break;
      default:
        break;
    }
  }
  bound_to_capacity(e, added);
}

void SchedulerCore::bound_to_capacity(Engine& e, std::vector<Added>& added) {
  // Refusing the newest rather than evicting the oldest needs no per-block
  // order (the index keeps none); checking after the whole report rather
  // than at each store lets an engine list its stores before the removals
  // that made room for them (moelink-engine-sim does). Both the index and
  // the hash map are bounded: the map grows with distinct engine hashes even
  // when they name blocks already indexed.
  const uint64_t cap = e.info.kv_capacity_blocks();
  while (!added.empty() && (index_.confirmed_blocks(e.slot) > cap || e.hash_map.size() > cap)) {
    const Added a = added.back();
    added.pop_back();
    bool undone = false;
    if (a.mapped) {
      auto it = e.hash_map.find(a.engine_hash);
      if (it != e.hash_map.end() && it->second == a.hash) {
        e.hash_map.erase(it);
        undone = true;
      }
    }
    // Removed again later in the report: nothing to take back (and remove()
    // would also clear a provisional mark the engine still has).
    if (a.indexed && index_.holds(e.slot, a.hash)) {
      index_.remove(e.slot, a.hash);
      undone = true;
    }
    if (undone) ++e.refused_kv_blocks;
  }
}

Status SchedulerCore::report(const v1::EngineReport& r, v1::ReportResponse* resp,
                             Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine* e = nullptr;
  if (Status s = check_current(r.engine_id(), r.incarnation(), &e); !s.ok()) return s;
  // Not FAILED_PRECONDITION: engine clients take that for fencing and
  // register again.
  if (r.seq() <= e->last_seq)
    return Status(StatusCode::ALREADY_EXISTS,
                  "report seq " + std::to_string(r.seq()) + " of engine '" + e->id +
                      "' is not above the last accepted " + std::to_string(e->last_seq) +
                      " (out of order or repeated); nothing was applied");
  if (Status s = validate_report(r); !s.ok()) return s;
  e->last_seq = r.seq();
  e->last_heard = now;
  e->reported = r.load();
  e->redirect_tokens = e->redirect_prefill_tokens = 0;
  e->redirect_requests = 0;
  apply_events(*e, r);
  for (const v1::RequestProgress& p : r.progress())
    if (!apply_progress(*e, p, now)) resp->add_revoked(p.request_id());
  resp->set_acked_seq(r.seq());
  return Status::OK;
}

bool SchedulerCore::apply_progress(Engine& e, const v1::RequestProgress& p, Clock::time_point now) {
  auto it = requests_.find(p.request_id());
  Request* r = it == requests_.end() ? nullptr : it->second.get();
  // Progress of a request no longer this engine's (cancelled, re-routed,
  // finished) is a race, not an error: the reply revokes it.
  if (r == nullptr || r->slot != e.slot || r->incarnation != e.incarnation ||
      (r->state != RequestState::kQueued && r->state != RequestState::kRunning)) {
    ++ignored_progress_;
    return false;
  }
  using P = v1::RequestProgress;
  if (p.phase() == P::REJECTED && r->state == RequestState::kQueued) {
    r->refused_by.push_back(e.slot);
    reroute(*r, now);
    return true;
  }
  if (r->state == RequestState::kQueued) mark_started(*r, e, p.cached_tokens());
  if (p.phase() == P::STARTED && p.cached_tokens() > 0) r->cached = p.cached_tokens();
  add_output(*r, p);
  if (p.phase() == P::HANDED_OFF) {
    hand_off(*r, e, p.handed_to(), now);
    return true;
  }
  if (p.phase() == P::FINISHED) {
    finish(*r, Status::OK, p.finish_reason().empty() ? "length" : p.finish_reason(), now);
  } else if (p.phase() == P::FAILED || p.phase() == P::REJECTED) {
    finish(*r,
           Status(StatusCode::ABORTED, "engine '" + e.id + "' failed request " + r->id + ": " +
                                           (p.finish_reason().empty() ? "no reason given"
                                                                      : p.finish_reason())),
           "error", now);
  }
  return true;
}

void SchedulerCore::hand_off(Request& r, Engine& from, const std::string& to, Clock::time_point now) {
  Engine* d = find_engine(to);
  if (d == nullptr || !d->routable() || d->info.role() != v1::ROLE_DECODE) {
    finish(r,
           Status(StatusCode::UNAVAILABLE, "engine '" + from.id + "' handed request " + r.id +
                                               " to '" + to + "', which is not a live decode engine"),
           "engine_lost", now);
    return;
  }
  // The request runs on the decode engine from now: its reports are the
  // ones accepted, and it is failed with it.
  detach(r);
  r.slot = d->slot;
  r.incarnation = d->incarnation;
  d->requests.insert(&r);
  ++d->running;
  const uint64_t max_new = r.req.sampling().max_new_tokens();
  d->remaining_output_tokens += max_new - std::min<uint64_t>(max_new, r.output.size());
  d->load_tokens += r.req.prompt_tokens_size() + r.output.size();
  ++d->assigned_total;
  ++handed_off_;
}

Status SchedulerCore::leave(const v1::LeaveRequest& req, v1::LeaveResponse* resp,
                            Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine* e = nullptr;
  if (Status s = check_current(req.engine_id(), req.incarnation(), &e); !s.ok()) return s;
  if (req.drain()) {
    // It finishes what it holds, queued ones included (re-routing those
    // could run them twice); nothing new goes to it.
    e->state = EngineState::kDraining;
    resp->set_rerouted(0);
    return Status::OK;
  }
  const uint64_t before = rerouted_;
  drop_engine(*e, EngineState::kLeft, Status::OK, "left the pool", now);
  resp->set_rerouted(static_cast<uint32_t>(rerouted_ - before));
  return Status::OK;
}

void SchedulerCore::drop_engine(Engine& e, EngineState new_state, const Status& stream_status,
                                const std::string& why, Clock::time_point now) {
  e.state = new_state;
  if (e.sink) e.sink->close(stream_status);
  e.sink.reset();
  index_.clear(e.slot);
  e.hash_map.clear();
  std::vector<Request*> held(e.requests.begin(), e.requests.end());
  for (Request* r : held) {
    if (r->state == RequestState::kQueued) {
      reroute(*r, now);
    } else {
      finish(*r,
             Status(StatusCode::UNAVAILABLE,
                    "engine '" + e.id + "' " + why + " after request " + r->id + " started"),
             "engine_lost", now);
    }
  }
}

// ------------------------------------------------------------------ requests

Status SchedulerCore::submit(v1::GenerateRequest req, std::shared_ptr<ClientSink> sink,
                             Clock::time_point now) {
  if (Status s = validate_generate(req, options_); !s.ok()) return s;
  const auto t0 = Clock::now();
  auto r = std::make_unique<Request>();
  r->id = req.request_id().empty() ? new_request_id() : req.request_id();
  r->req.Swap(&req);
  r->req.set_request_id(r->id);
  prompt_block_hashes(tokens_of(r->req.prompt_tokens()), options_.block_size, r->hashes);
  r->client = std::move(sink);
  r->pending_since = now;
  const double hash_us = us_between(t0, Clock::now());

  std::lock_guard<std::mutex> lock(mu_);
  if (requests_.contains(r->id))
    return Status(StatusCode::ALREADY_EXISTS, "request_id '" + r->id + "' was already accepted");
  uint64_t largest = 0;
  bool any = false;
  for (const auto& e : engines_) {
    if (e->state == EngineState::kDead || e->state == EngineState::kLeft) continue;
    any = true;
    largest = std::max<uint64_t>(largest, e->info.kv_capacity_blocks() * options_.block_size);
  }
  if (any && static_cast<uint64_t>(r->req.prompt_tokens_size()) + r->req.sampling().max_new_tokens() > largest)
    return Status(StatusCode::OUT_OF_RANGE,
                  "prompt_tokens (" + std::to_string(r->req.prompt_tokens_size()) +
                      ") + sampling.max_new_tokens (" +
                      std::to_string(r->req.sampling().max_new_tokens()) +
                      ") exceed the largest engine's KV cache (" + std::to_string(largest) +
                      " tokens)");
  r->hash_us = hash_us;
  if (r->req.redirect()) {
    // Nothing to track: the client takes the request to the engine itself.
    route_redirect(*r, r->client, now);
    return Status::OK;
  }
  Request& ref = *r;
  ref.state = log_ ? RequestState::kLogging : RequestState::kPending;
  requests_.emplace(ref.id, std::move(r));
  ++accepted_;
  if (log_) {
    // Acknowledge (and route) once the record is on disk.
    log_->append_accept(ref.req, [this, id = ref.id] { accept_durable(id, Clock::now()); });
    return Status::OK;
  }
  route(ref, now);
  return Status::OK;
}

void SchedulerCore::accept_durable(const std::string& id, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->state != RequestState::kLogging) return;
  it->second->state = RequestState::kPending;
  route(*it->second, now);
}

EngineView SchedulerCore::view_of(const Engine& e) const {
  EngineView v;
  v.slot = e.slot;
  v.load_tokens = std::max<uint64_t>(e.load_tokens, e.reported.active_tokens()) + e.redirect_tokens;
  v.queued_prefill_tokens =
      std::max<uint64_t>(e.queued_prefill_tokens, e.reported.waiting_prefill_tokens()) +
      e.redirect_prefill_tokens;
  v.running = std::max(e.running, e.reported.running());
  v.waiting = std::max(e.queued, e.reported.waiting()) + e.redirect_requests;
  v.max_batch = e.info.max_batch();
  v.remaining_output_tokens = e.remaining_output_tokens;
  v.prefill_us_per_token = e.info.prefill_us_per_token();
  v.decode_step_us = e.info.decode_step_us();
  return v;
}

void SchedulerCore::build_views(const Request& r, bool need_address) {
  views_.clear();
  EngineSet set;
  for (const auto& e : engines_) {
    if (!e->routable() || e->info.role() == v1::ROLE_DECODE) continue;  // decode engines take hand-offs only
    if (need_address && e->info.address().empty()) continue;
    if (std::find(r.refused_by.begin(), r.refused_by.end(), e->slot) != r.refused_by.end()) continue;
    views_.push_back(view_of(*e));
    set.set(e->slot);
  }
  if (views_.empty()) return;
  index_.match(r.hashes, set, matched_);
  const uint32_t prompt = static_cast<uint32_t>(r.req.prompt_tokens_size());
  for (EngineView& v : views_)
    v.matched_tokens = std::min(prompt, matched_[v.slot] * options_.block_size);
}

bool SchedulerCore::try_route(Request& r, Clock::time_point now) {
  const auto t0 = Clock::now();
  build_views(r, false);
  if (views_.empty()) return false;
  const uint32_t prompt = static_cast<uint32_t>(r.req.prompt_tokens_size());
  Choice c;
  // Sticky session: stay on the session's engine while it is live and not
  // far over the load bound (Policy::keeps_session).
  if (!r.req.session_id().empty()) {
    auto it = sessions_.find(r.req.session_id());
    if (it != sessions_.end()) {
      for (const EngineView& v : views_)
        if (v.slot == it->second.slot && policy_->keeps_session(v, prompt, views_)) {
          c = Choice{v.slot, v.matched_tokens, estimated_ttft_us(v, prompt)};
          break;
        }
    }
  }
  if (c.slot < 0) c = policy_->choose(prompt, views_);
  ++decisions_;
  decision_us_.add(r.hash_us + us_between(t0, Clock::now()));
  r.hash_us = 0;
  assign(r, *engines_[c.slot], c, now);
  return true;
}

void SchedulerCore::route(Request& r, Clock::time_point now) {
  if (try_route(r, now)) return;
  r.state = RequestState::kPending;
  pending_.push_back(r.id);
}

void SchedulerCore::route_redirect(Request& r, std::shared_ptr<ClientSink> sink,
                                   Clock::time_point now) {
  const auto t0 = Clock::now();
  build_views(r, true);
  if (views_.empty()) {
    sink->close(Status(StatusCode::UNAVAILABLE,
                       "no live engine registered an address; redirect needs one"));
    return;
  }
  const uint32_t prompt = static_cast<uint32_t>(r.req.prompt_tokens_size());
  Choice c = policy_->choose(prompt, views_);
  ++decisions_;
  decision_us_.add(r.hash_us + us_between(t0, Clock::now()));
  Engine& e = *engines_[c.slot];
  // The engine hears of the request from the client; count it until its next report.
  e.redirect_tokens += prompt;
  e.redirect_prefill_tokens += prompt - c.cached_tokens;
  ++e.redirect_requests;
  ++e.assigned_total;
  note_routing(r, e, c, now);
  v1::GenerateEvent ev;
  v1::Redirect* rd = ev.mutable_redirect();
  rd->set_request_id(r.id);
  rd->set_engine_id(e.id);
  rd->set_address(e.info.address());
  rd->set_expected_cached_tokens(c.cached_tokens);
  sink->send(std::move(ev));
  sink->close(Status::OK);
}

void SchedulerCore::note_routing(const Request& r, const Engine& e, const Choice& c,
                                 Clock::time_point now) {
  // The prompt's blocks count as the engine's until its events say so (or
  // the mark expires). The matched prefix is held there already.
  const size_t held = std::min<size_t>(r.hashes.size(), c.cached_tokens / options_.block_size);
  index_.add_provisional(e.slot, std::span<const uint64_t>(r.hashes).subspan(held),
                         now + ms(options_.provisional_ttl_ms));
  if (!r.req.session_id().empty()) remember_session(r.req.session_id(), e.slot, now);
}

void SchedulerCore::assign(Request& r, Engine& e, const Choice& c, Clock::time_point now) {
  const uint32_t prompt = static_cast<uint32_t>(r.req.prompt_tokens_size());
  r.slot = e.slot;
  r.incarnation = e.incarnation;
  r.expected_cached = c.cached_tokens;
  r.uncached_estimate = prompt - std::min(prompt, c.cached_tokens);
  r.state = RequestState::kQueued;
  e.requests.insert(&r);
  ++e.queued;
  e.queued_prefill_tokens += r.uncached_estimate;
  e.load_tokens += prompt + r.output.size();
  ++e.assigned_total;
  note_routing(r, e, c, now);
  if (e.sink) {
    v1::Assignment a;
    v1::RunRequest* run = a.mutable_run();
    run->set_request_id(r.id);
    *run->mutable_prompt_tokens() = r.req.prompt_tokens();
    *run->mutable_sampling() = r.req.sampling();
    run->set_expected_cached_tokens(c.cached_tokens);
    if (e.info.role() == v1::ROLE_PREFILL) {
      if (const Engine* d = decode_engine_for()) {
        run->set_decode_engine_id(d->id);
        run->set_decode_handoff_address(d->info.handoff_address());
      }
    }
    e.sink->send(std::move(a));
  }
  if (r.client) {
    v1::GenerateEvent ev;
    v1::Accepted* acc = ev.mutable_accepted();
    acc->set_request_id(r.id);
    acc->set_engine_id(e.id);
    acc->set_expected_cached_tokens(c.cached_tokens);
    r.client->send(std::move(ev));
  }
}

const SchedulerCore::Engine* SchedulerCore::decode_engine_for() const {
  // The live decode engine with the fewest tokens to hold for what it
  // runs, then the fewest requests.
  const Engine* best = nullptr;
  for (const auto& e : engines_) {
    if (!e->routable() || e->info.role() != v1::ROLE_DECODE) continue;
    const uint32_t room = e->info.max_batch();
    if (best == nullptr || std::make_tuple(e->running >= room, e->load_tokens, e->running) <
                               std::make_tuple(best->running >= best->info.max_batch(), best->load_tokens,
                                               best->running))
      best = e.get();
  }
  return best;
}

void SchedulerCore::mark_started(Request& r, Engine& e, uint32_t cached_tokens) {
  r.state = RequestState::kRunning;
  r.cached = cached_tokens;
  --e.queued;
  e.queued_prefill_tokens -= std::min(e.queued_prefill_tokens, r.uncached_estimate);
  ++e.running;
  const uint64_t max_new = r.req.sampling().max_new_tokens();
  e.remaining_output_tokens += max_new - std::min<uint64_t>(max_new, r.output.size());
  if (log_) log_->append_started(r.id);
}

void SchedulerCore::detach(Request& r) {
  if (r.slot < 0) return;
  Engine& e = *engines_[r.slot];
  if (r.state == RequestState::kQueued) {
    --e.queued;
    e.queued_prefill_tokens -= std::min(e.queued_prefill_tokens, r.uncached_estimate);
  } else if (r.state == RequestState::kRunning) {
    --e.running;
    const uint64_t max_new = r.req.sampling().max_new_tokens();
    const uint64_t left = max_new - std::min<uint64_t>(max_new, r.output.size());
    e.remaining_output_tokens -= std::min(e.remaining_output_tokens, left);
  }
  const uint64_t held = r.req.prompt_tokens_size() + r.output.size();
  e.load_tokens -= std::min(e.load_tokens, held);
  e.requests.erase(&r);
  r.slot = -1;
}

void SchedulerCore::add_output(Request& r, const v1::RequestProgress& p) {
  // Skip what is already known (a retried report); a gap would be an engine bug.
  const size_t have = r.output.size();
  const size_t end = static_cast<size_t>(p.token_offset()) + p.new_tokens_size();
  if (end <= have || p.token_offset() > have) return;
  const int skip = static_cast<int>(have - p.token_offset());
  const int fresh = p.new_tokens_size() - skip;
  if (r.slot >= 0 && r.state == RequestState::kRunning) {
    Engine& e = *engines_[r.slot];
    const uint64_t max_new = r.req.sampling().max_new_tokens();
    const uint64_t before = max_new - std::min<uint64_t>(max_new, r.output.size());
    const uint64_t after = max_new - std::min<uint64_t>(max_new, r.output.size() + fresh);
    e.remaining_output_tokens -= std::min(e.remaining_output_tokens, before - after);
    e.load_tokens += fresh;
  }
  r.output.insert(r.output.end(), p.new_tokens().begin() + skip, p.new_tokens().end());
  forward(r, false);
}

void SchedulerCore::forward(Request& r, bool flush) {
  if (!r.client || r.forwarded >= r.output.size()) return;
  const uint32_t interval = std::max<uint32_t>(1, r.req.stream_interval());
  const size_t unsent = r.output.size() - r.forwarded;
  if (!flush && r.forwarded > 0 && unsent < interval) return;
  v1::GenerateEvent ev;
  v1::Tokens* t = ev.mutable_tokens();
  t->set_offset(r.forwarded);
  t->mutable_token_ids()->Add(r.output.begin() + r.forwarded, r.output.end());
  r.forwarded = static_cast<uint32_t>(r.output.size());
  r.client->send(std::move(ev));
}

v1::GenerateEvent SchedulerCore::finished_event(const Request& r) {
  v1::GenerateEvent ev;
  v1::Finished* f = ev.mutable_finished();
  f->set_finish_reason(r.finish_reason);
  f->set_output_tokens(static_cast<uint32_t>(r.output.size()));
  f->set_cached_tokens(r.cached);
  f->set_engine_id(r.finished_on);
  return ev;
}

void SchedulerCore::finish(Request& r, const Status& status, const std::string& reason,
                           Clock::time_point now) {
  r.finished_on = r.slot >= 0 ? engines_[r.slot]->id : "";
  detach(r);
  // Kept for Resume until retention_ms passes: the output, not the prompt.
  r.req.clear_prompt_tokens();
  r.hashes = {};
  r.state = RequestState::kDone;
  r.done_at = now;
  r.finish_reason = reason;
  r.final_status = status;
  if (status.ok()) {
    ++finished_;
  } else {
    ++failed_;
  }
  if (log_) log_->append_done(r.id);
  if (r.client) {
    if (status.ok()) {
      forward(r, true);
      r.client->send(finished_event(r));
    }
    r.client->close(status);
    r.client.reset();
  }
  done_order_.push_back(r.id);
}

void SchedulerCore::reroute(Request& r, Clock::time_point now) {
  Engine* from = r.slot >= 0 ? engines_[r.slot].get() : nullptr;
  if (from && from->sink && r.state == RequestState::kQueued) {
    v1::Assignment a;
    a.mutable_cancel()->set_request_id(r.id);
    a.mutable_cancel()->set_reason("re-routed");
    from->sink->send(std::move(a));
  }
  detach(r);
  ++rerouted_;
  r.state = RequestState::kPending;
  r.pending_since = now;
  route(r, now);
}

void SchedulerCore::route_pending(Clock::time_point now) {
  const size_t n = pending_.size();
  for (size_t i = 0; i < n; ++i) {
    std::string id = std::move(pending_.front());
    pending_.pop_front();
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second->state != RequestState::kPending) continue;
    Request& r = *it->second;
    if (!try_route(r, now)) {
      if (now - r.pending_since > ms(options_.queue_timeout_ms)) {
        finish(r,
               Status(StatusCode::RESOURCE_EXHAUSTED,
                      "no engine could take request " + r.id + " within " +
                          std::to_string(options_.queue_timeout_ms) + " ms (--queue-timeout-ms)"),
               "no_engine", now);
      } else {
        pending_.push_back(std::move(id));
      }
    }
  }
}

void SchedulerCore::remember_session(const std::string& session, int slot, Clock::time_point now) {
  auto [it, inserted] = sessions_.try_emplace(session);
  if (!inserted) session_lru_.erase(it->second.lru);
  it->second.slot = slot;
  it->second.last_used = now;
  it->second.lru = session_lru_.insert(session_lru_.end(), session);
}

Status SchedulerCore::resume(const v1::ResumeRequest& req, std::shared_ptr<ClientSink> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(req.request_id());
  if (it == requests_.end())
    return Status(StatusCode::NOT_FOUND,
                  "request_id '" + req.request_id() +
                      "' is unknown (never accepted, or finished more than retention_ms ago)");
  Request& r = *it->second;
  // A request that failed answers with its own status, whatever from_token.
  if (r.state == RequestState::kDone && !r.final_status.ok()) return r.final_status;
  // A request recovered from the log knows no output until its engine comes
  // back with it: the stream starts at from_token then.
  if (r.state != RequestState::kRecovered && req.from_token() > r.output.size())
    return Status(StatusCode::OUT_OF_RANGE,
                  "from_token " + std::to_string(req.from_token()) + " is beyond the " +
                      std::to_string(r.output.size()) + " output tokens of request " + r.id);
  if (r.client) r.client->close(Status(StatusCode::ABORTED, "request resumed by another stream"));
  r.client = std::move(sink);
  r.forwarded = req.from_token();
  if (r.slot >= 0) {
    v1::GenerateEvent ev;
    ev.mutable_accepted()->set_request_id(r.id);
    ev.mutable_accepted()->set_engine_id(engines_[r.slot]->id);
    ev.mutable_accepted()->set_expected_cached_tokens(r.expected_cached);
    r.client->send(std::move(ev));
  }
  if (r.state == RequestState::kDone) {
    forward(r, true);
    r.client->send(finished_event(r));
    r.client->close(Status::OK);
    r.client.reset();
    return Status::OK;
  }
  forward(r, true);
  return Status::OK;
}

Status SchedulerCore::cancel(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second->state == RequestState::kDone)
    return Status(StatusCode::NOT_FOUND, "request_id '" + request_id + "' is not in flight");
  Request& r = *it->second;
  if (r.slot >= 0 && engines_[r.slot]->sink) {
    v1::Assignment a;
    a.mutable_cancel()->set_request_id(r.id);
    a.mutable_cancel()->set_reason("cancelled by the client");
    engines_[r.slot]->sink->send(std::move(a));
  }
  finish(r, Status(StatusCode::CANCELLED, "request " + r.id + " was cancelled"), "cancelled",
         Clock::now());
  return Status::OK;
}

void SchedulerCore::client_gone(const std::string& request_id, const ClientSink* sink) {
  std::lock_guard<std::mutex> lock(gone_mu_);
  gone_clients_.emplace_back(request_id, sink);
}

// ------------------------------------------------------------------ time

void SchedulerCore::tick(Clock::time_point now) {
  std::vector<std::pair<std::string, const ClientSink*>> gone;
  std::vector<std::pair<std::string, const EngineSink*>> gone_streams;
  {
    std::lock_guard<std::mutex> lock(gone_mu_);
    gone.swap(gone_clients_);
    gone_streams.swap(gone_engine_streams_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Engines whose assignment stream ended: not routable until they attach
  // again. Their queued requests move at once (safe: an engine starts a
  // request only after the scheduler acknowledged STARTED, and a moved
  // request's STARTED is revoked); started ones stay until the heartbeat
  // deadline or the engine's next registration (it may still run them).
  for (const auto& [id, sink] : gone_streams) {
    Engine* e = find_engine(id);
    if (e == nullptr || e->sink.get() != sink) continue;
    e->sink.reset();
    if (e->state == EngineState::kLive) e->state = EngineState::kRegistered;
    std::vector<Request*> queued;
    for (Request* r : e->requests)
      if (r->state == RequestState::kQueued) queued.push_back(r);
    for (Request* r : queued) reroute(*r, now);
  }
  // Clients that went away: their requests are cancelled at the engine.
  for (const auto& [id, sink] : gone) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = *it->second;
    if (r.client.get() != sink) continue;  // resumed on another stream since
    r.client.reset();
    if (r.state == RequestState::kDone) continue;
    if (r.slot >= 0 && engines_[r.slot]->sink) {
      v1::Assignment a;
      a.mutable_cancel()->set_request_id(r.id);
      a.mutable_cancel()->set_reason("the client went away");
      engines_[r.slot]->sink->send(std::move(a));
    }
    finish(r, Status(StatusCode::CANCELLED, "client went away"), "cancelled", now);
  }
  // Heartbeats: an engine silent past the deadline is drained.
  for (auto& e : engines_) {
    if (e->state == EngineState::kDead || e->state == EngineState::kLeft) continue;
    if (now - e->last_heard > ms(options_.heartbeat_timeout_ms))
      drop_engine(*e, EngineState::kDead,
                  Status(StatusCode::UNAVAILABLE,
                         "no report for " + std::to_string(options_.heartbeat_timeout_ms) +
                             " ms (heartbeat_timeout_ms): drained"),
                  "stopped heartbeating", now);
  }
  index_.expire(now);
  // After a restart: logged requests no engine claimed in time.
  if (recovering_ && now >= recovery_deadline_) {
    recovering_ = false;
    for (auto& [id, r] : requests_) {
      if (r->state != RequestState::kRecovered) continue;
      if (r->started_before_restart) {
        finish(*r,
               Status(StatusCode::UNAVAILABLE,
                      "request " + id +
                          " had started on an engine that did not return after the scheduler "
                          "restarted"),
               "engine_lost", now);
      } else {
        r->state = RequestState::kPending;
        r->pending_since = now;
        pending_.push_back(id);
      }
    }
  }
  route_pending(now);
  // Retention of finished requests (for Resume).
  while (!done_order_.empty()) {
    auto it = requests_.find(done_order_.front());
    if (it != requests_.end() && it->second->state == RequestState::kDone &&
        now - it->second->done_at < ms(options_.retention_ms))
      break;
    if (it != requests_.end() && it->second->state == RequestState::kDone) requests_.erase(it);
    done_order_.pop_front();
  }
  while (!session_lru_.empty()) {
    auto it = sessions_.find(session_lru_.front());
    if (now - it->second.last_used < ms(options_.session_ttl_ms)) break;
    sessions_.erase(it);
    session_lru_.pop_front();
  }
}

void SchedulerCore::stats(v1::Stats* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  out->set_policy(to_string(policy_->kind()));
  for (const auto& e : engines_) {
    if (e->id.empty()) continue;
    v1::EngineStats* s = out->add_engines();
    s->set_engine_id(e->id);
    s->set_dp_rank(e->info.dp_rank());
    s->set_alive(e->state == EngineState::kLive || e->state == EngineState::kDraining ||
                 e->state == EngineState::kRegistered);
    s->set_draining(e->state == EngineState::kDraining);
    s->set_incarnation(e->incarnation);
    *s->mutable_load() = e->reported;
    s->set_indexed_blocks(index_.confirmed_blocks(e->slot));
    s->set_dropped_kv_events(e->dropped_kv_events);
    s->set_refused_kv_blocks(e->refused_kv_blocks);
    s->set_role(e->info.role());
    s->set_assigned(e->assigned_total);
    s->set_outstanding(e->requests.size());
  }
  out->set_accepted(accepted_);
  out->set_finished(finished_);
  out->set_failed(failed_);
  out->set_rerouted(rerouted_);
  out->set_decisions(decisions_);
  out->set_decision_p50_us(decision_us_.percentile(0.5));
  out->set_decision_p99_us(decision_us_.percentile(0.99));
  out->set_decision_max_us(decision_us_.max());
  uint64_t in_flight = 0;
  for (const auto& [id, r] : requests_)
    if (r->state != RequestState::kDone) ++in_flight;
  out->set_requests_in_flight(in_flight);
  out->set_handed_off(handed_off_);
}

}  // namespace moelink::scheduler
