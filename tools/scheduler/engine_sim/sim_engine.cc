#include "sim_engine.h"

#include <algorithm>

#include "moelink/scheduler/block_hash.h"

namespace moelink::scheduler::sim {
namespace {

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

constexpr int64_t kSampleEveryUs = 250000;
// Hashes published with --events-with-tokens are the engine's own (as a
// vLLM engine's are): the scheduler maps them through the token ids.
constexpr uint64_t kEngineHashSalt = 0x5eed5eed5eed5eedull;

}  // namespace

struct SimEngine::Request {
  std::string id;
  bool from_scheduler = false;
  std::vector<uint32_t> prompt;
  uint32_t max_new = 1;
  std::vector<uint64_t> hashes;  // the prompt's full blocks
  uint64_t prompt_hash = 0;
  std::shared_ptr<LocalStream> local;
  // Cache state while admitted.
  uint32_t cached_blocks = 0;
  uint64_t reserved = 0;
  std::vector<uint64_t> pinned;
  // Output and what the scheduler has acknowledged of it.
  std::vector<uint32_t> output;
  uint32_t acked_tokens = 0;
  bool started = false;       // STARTED acknowledged (or local)
  bool finished = false;
  bool cancelled = false;
  RequestRecord record;
};

uint32_t SimEngine::output_token(uint64_t prompt_hash, uint32_t i) {
  return 1000 + static_cast<uint32_t>(splitmix64(prompt_hash + i) % 30000);
}

SimEngine::SimEngine(const SimOptions& o, const CostModel& cost)
    : o_(o), cost_(cost), cache_(o.kv_blocks) {}

SimEngine::~SimEngine() {
  stop();
  client_.reset();
}

double SimEngine::prefill_us_per_token() const { return cost_.prefill_us_per_token() * o_.time_scale; }

double SimEngine::decode_step_us() const {
  return cost_.decode_step_us(o_.max_batch, 4096) * o_.time_scale;
}

void SimEngine::connect(EngineClientOptions co, std::chrono::milliseconds timeout) {
  co.info.set_engine_id(o_.engine_id);
  co.info.set_dp_rank(o_.dp_rank);
  co.info.set_kv_capacity_blocks(o_.kv_blocks);
  co.info.set_block_size(o_.block_size);
  co.info.set_max_batch(o_.max_batch);
  co.info.set_address(o_.address);
  co.info.set_prefill_us_per_token(prefill_us_per_token());
  co.info.set_decode_step_us(decode_step_us());
  EngineHandlers h;
  h.on_run = [this](const v1::RunRequest& r) { on_run(r); };
  h.on_cancel = [this](const v1::CancelRun& c) { on_cancel(c.request_id()); };
  h.on_released = [this](const std::vector<std::string>& ids) { on_released(ids); };
  h.held = [this] { return held(); };
  h.load = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return load_locked();
  };
  client_ = std::make_unique<EngineClient>(std::move(co), std::move(h));
  client_->start(timeout);
}

void SimEngine::start() {
  thread_ = std::thread([this] { loop(); });
  if (client_) reporter_ = std::thread([this] { reporter(); });
}

void SimEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  report_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (reporter_.joinable()) reporter_.join();
  // Local streams still waiting end now (their HTTP responses finish).
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : requests_) {
    if (!r->local) continue;
    std::lock_guard<std::mutex> l(r->local->mu);
    r->local->done = true;
    r->local->cv.notify_all();
  }
}

void SimEngine::leave() {
  if (client_) client_->leave(false);
}

// ------------------------------------------------------------------ arrivals

void SimEngine::on_run(const v1::RunRequest& run) {
  auto r = std::make_unique<Request>();
  r->id = run.request_id();
  r->from_scheduler = true;
  r->prompt.assign(run.prompt_tokens().begin(), run.prompt_tokens().end());
  r->max_new = std::max<uint32_t>(1, run.sampling().max_new_tokens());
  r->hashes = prompt_block_hashes(r->prompt, o_.block_size);
  r->prompt_hash = block_hash(kRootBlockHash, r->prompt);
  r->record.id = r->id;
  r->record.prompt_tokens = static_cast<uint32_t>(r->prompt.size());
  r->record.arrival_us = wall_us();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = requests_.find(r->id); it != requests_.end()) {
    // The scheduler may give back a request this engine has just released
    // (revoked or cancelled, not yet dropped at the next step): the new copy
    // replaces the old once that is dropped. Anything else is a duplicate.
    if (it->second->cancelled) reassigned_[r->id] = std::move(r);
    return;
  }
  waiting_.push_back(r.get());
  requests_.emplace(r->id, std::move(r));
  cv_.notify_all();
}

void SimEngine::submit_local(const std::string& id, std::vector<uint32_t> prompt, uint32_t max_new,
                             std::shared_ptr<LocalStream> stream) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->prompt = std::move(prompt);
  r->max_new = std::max<uint32_t>(1, max_new);
  r->hashes = prompt_block_hashes(r->prompt, o_.block_size);
  r->prompt_hash = block_hash(kRootBlockHash, r->prompt);
  r->local = std::move(stream);
  r->record.id = id;
  r->record.prompt_tokens = static_cast<uint32_t>(r->prompt.size());
  r->record.arrival_us = wall_us();
  std::lock_guard<std::mutex> lock(mu_);
  waiting_.push_back(r.get());
  requests_.emplace(id, std::move(r));
  cv_.notify_all();
}

void SimEngine::on_cancel(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  if (it != requests_.end()) it->second->cancelled = true;
  reassigned_.erase(id);  // a cancel names the latest assignment
  cv_.notify_all();
}

void SimEngine::on_released(const std::vector<std::string>& ids) {
  for (const auto& id : ids) on_cancel(id);
}

std::vector<v1::HeldRequest> SimEngine::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::HeldRequest> out;
  for (const auto& [id, r] : requests_) {
    if (!r->from_scheduler || r->cancelled) continue;
    v1::HeldRequest h;
    h.set_request_id(id);
    h.set_started(r->started);
    h.mutable_output_tokens()->Add(r->output.begin(), r->output.end());
    out.push_back(std::move(h));
  }
  return out;
}

v1::EngineLoad SimEngine::load_locked() const {
  v1::EngineLoad l;
  uint64_t active = 0, waiting_prefill = 0;
  for (const Request* r : running_) active += r->prompt.size() + r->output.size();
  for (const Request* r : waiting_) {
    active += r->prompt.size();
    const uint64_t cached = static_cast<uint64_t>(cache_.match(r->hashes)) * o_.block_size;
    waiting_prefill += r->prompt.size() - std::min<uint64_t>(cached, r->prompt.size());
  }
  l.set_running(static_cast<uint32_t>(running_.size()));
  l.set_waiting(static_cast<uint32_t>(waiting_.size()));
  l.set_free_kv_blocks(cache_.free_blocks() + cache_.evictable_blocks());
  l.set_waiting_prefill_tokens(waiting_prefill);
  l.set_active_tokens(active);
  return l;
}

// ------------------------------------------------------------------ the loop

void SimEngine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    sample_locked(wall_us());
    const bool idle = waiting_.empty() && running_.empty();
    // Nothing to do, or only requests waiting for memory: wait for an arrival.
    if (idle || !step(lock)) cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
}

void SimEngine::sample_locked(int64_t now_us) {
  if (now_us < next_sample_us_) return;
  next_sample_us_ = now_us + kSampleEveryUs;
  const v1::EngineLoad l = load_locked();
  samples_.push_back({now_us, l.active_tokens(), l.waiting_prefill_tokens(), l.running(), l.waiting()});
}

uint64_t SimEngine::engine_hash(uint64_t h) const {
  return o_.events_with_tokens ? splitmix64(h ^ kEngineHashSalt) : h;
}

void SimEngine::admit(std::vector<Request*>& admitted, std::vector<uint64_t>& evicted) {
  uint64_t prefill_tokens = 0;
  while (!waiting_.empty() && running_.size() + admitted.size() < o_.max_batch) {
    Request* r = waiting_.front();
    if (r->cancelled) {
      waiting_.pop_front();
      drop(*r);
      continue;
    }
    const uint32_t m = cache_.match(r->hashes);
    const uint64_t uncached = std::max<uint64_t>(1, r->prompt.size() - uint64_t{m} * o_.block_size);
    if (!admitted.empty() && prefill_tokens + uncached > o_.max_prefill_tokens) break;
    const uint64_t blocks = (r->prompt.size() + r->max_new + o_.block_size - 1) / o_.block_size;
    const uint64_t need = blocks - std::min<uint64_t>(blocks, m);
    // Pin the prefix first so making room cannot evict it.
    cache_.pin(std::span<const uint64_t>(r->hashes.data(), m));
    if (!cache_.reserve(need, evicted)) {
      cache_.unpin(std::span<const uint64_t>(r->hashes.data(), m));
      break;  // waits for memory
    }
    r->cached_blocks = m;
    r->reserved = need;
    r->pinned.assign(r->hashes.begin(), r->hashes.begin() + m);
    prefill_tokens += uncached;
    admitted.push_back(r);
    waiting_.pop_front();
  }
}

void SimEngine::revert(Request& r) {
  cache_.unpin(r.pinned);
  cache_.release(r.reserved);
  r.pinned.clear();
  r.reserved = 0;
  r.cached_blocks = 0;
}

void SimEngine::drop(Request& r) {
  if (!r.pinned.empty() || r.reserved) revert(r);
  if (r.local) {
    std::lock_guard<std::mutex> l(r.local->mu);
    r.local->done = true;
    r.local->cv.notify_all();
  }
  erase(&r);
}

void SimEngine::erase(Request* r) {
  const std::string id = r->id;  // the key must outlive the erase
  requests_.erase(id);
  if (auto it = reassigned_.find(id); it != reassigned_.end()) {
    waiting_.push_back(it->second.get());
    requests_.emplace(id, std::move(it->second));
    reassigned_.erase(it);
    cv_.notify_all();
  }
}

void SimEngine::stored_event(std::span<const uint64_t> hashes, std::span<const uint32_t> tokens,
                             size_t first_block, std::vector<v1::KvEvent>& events) {
  if (first_block >= hashes.size()) return;
  v1::BlocksStored* st = events.emplace_back().mutable_stored();
  for (size_t b = first_block; b < hashes.size(); ++b) st->add_block_hashes(engine_hash(hashes[b]));
  if (first_block > 0) st->set_parent_block_hash(engine_hash(hashes[first_block - 1]));
  if (o_.events_with_tokens)
    st->mutable_token_ids()->Add(tokens.begin() + static_cast<std::ptrdiff_t>(first_block * o_.block_size),
                                 tokens.begin() + static_cast<std::ptrdiff_t>(hashes.size() * o_.block_size));
}

void SimEngine::finish(Request& r, std::vector<v1::KvEvent>& events) {
  r.finished = true;
  r.record.finish_us = wall_us();
  r.record.output_tokens = static_cast<uint32_t>(r.output.size());
  // The whole sequence's full blocks stay cached (multi-turn reuse).
  std::vector<uint32_t> seq = r.prompt;
  seq.insert(seq.end(), r.output.begin(), r.output.end());
  const std::vector<uint64_t> all = prompt_block_hashes(seq, o_.block_size);
  for (size_t b = r.hashes.size(); b < all.size(); ++b) {
    cache_.store(all[b], b > 0, b > 0 ? all[b - 1] : 0);
    r.pinned.push_back(all[b]);
    --r.reserved;
  }
  stored_event(all, seq, r.hashes.size(), events);
  cache_.unpin(r.pinned);
  cache_.release(r.reserved);
  r.pinned.clear();
  r.reserved = 0;
  records_.push_back(r.record);
  if (r.local) {
    std::lock_guard<std::mutex> l(r.local->mu);
    r.local->output = r.output;
    r.local->done = true;
    r.local->e2e_us = static_cast<double>(r.record.finish_us - r.record.arrival_us);
    r.local->cv.notify_all();
  }
}

bool SimEngine::step(std::unique_lock<std::mutex>& lock) {
  // The modeled step time covers the report too, as a real engine's
  // scheduling overlaps the GPU's work: the step ends at start + duration.
  const auto step_start = std::chrono::steady_clock::now();
  std::vector<Request*> admitted;
  std::vector<uint64_t> evicted;
  admit(admitted, evicted);
  if (client_)  // events go to the scheduler; without one there is nobody to tell
    for (uint64_t h : evicted) pending_evictions_.push_back(engine_hash(h));

  // Requests from the scheduler start only once it acknowledged STARTED
  // (it may have given them to another engine meanwhile).
  std::vector<Request*> starting;
  for (Request* r : admitted)
    if (r->from_scheduler) starting.push_back(r);
  if (client_ && !starting.empty() && !report_locked(lock, starting)) {
    for (auto it = starting.rbegin(); it != starting.rend(); ++it) {
      revert(**it);
      waiting_.push_front(*it);
    }
    admitted.erase(std::remove_if(admitted.begin(), admitted.end(),
                                  [](Request* r) { return r->from_scheduler; }),
                   admitted.end());
    cv_.wait_for(lock, std::chrono::milliseconds(20));  // do not spin while the scheduler is away
  }
  // Cancelled (or revoked) requests leave at this safe point.
  auto cancelled = [](Request* r) { return r->cancelled; };
  for (Request* r : admitted)
    if (r->cancelled) drop(*r);
  admitted.erase(std::remove_if(admitted.begin(), admitted.end(), cancelled), admitted.end());
  std::vector<Request*> live;
  for (Request* r : running_) {
    if (r->cancelled) {
      drop(*r);
    } else {
      live.push_back(r);
    }
  }
  running_ = std::move(live);

  double step_us = 0;
  if (!admitted.empty()) {
    uint64_t tokens = 0;
    for (Request* r : admitted)
      tokens += std::max<uint64_t>(1, r->prompt.size() - uint64_t{r->cached_blocks} * o_.block_size);
    step_us = cost_.prefill_us(static_cast<double>(tokens));
  } else if (!running_.empty()) {
    double context = 0;
    for (Request* r : running_) context += static_cast<double>(r->prompt.size() + r->output.size());
    step_us = cost_.decode_step_us(static_cast<double>(running_.size()), context / running_.size());
  } else {
    return false;
  }
  lock.unlock();
  std::this_thread::sleep_until(step_start + std::chrono::nanoseconds(
                                                 static_cast<int64_t>(step_us * o_.time_scale * 1e3)));
  lock.lock();

  std::vector<v1::KvEvent> new_events;
  const int64_t now = wall_us();
  if (!admitted.empty()) {
    for (Request* r : admitted) {
      if (r->cancelled) {
        drop(*r);
        continue;
      }
      r->started = true;
      for (size_t b = r->cached_blocks; b < r->hashes.size(); ++b) {
        cache_.store(r->hashes[b], b > 0, b > 0 ? r->hashes[b - 1] : 0);
        r->pinned.push_back(r->hashes[b]);
        --r->reserved;
      }
      stored_event(r->hashes, r->prompt, r->cached_blocks, new_events);
      r->record.cached_tokens = static_cast<uint32_t>(
          std::min<uint64_t>(r->prompt.size(), uint64_t{r->cached_blocks} * o_.block_size));
      r->output.push_back(output_token(r->prompt_hash, 0));
      r->record.first_token_us = now;
      if (r->local) {
        std::lock_guard<std::mutex> l(r->local->mu);
        r->local->output = r->output;
        r->local->cached_tokens = r->record.cached_tokens;
        r->local->ttft_us = static_cast<double>(now - r->record.arrival_us);
        r->local->cv.notify_all();
      }
      running_.push_back(r);
    }
  } else {
    for (Request* r : running_) {
      r->output.push_back(output_token(r->prompt_hash, static_cast<uint32_t>(r->output.size())));
      if (r->local) {
        std::lock_guard<std::mutex> l(r->local->mu);
        r->local->output = r->output;
        r->local->cv.notify_all();
      }
    }
  }
  // Requests at max_new_tokens finish.
  std::vector<Request*> still;
  for (Request* r : running_) {
    if (r->output.size() < r->max_new) {
      still.push_back(r);
      continue;
    }
    finish(*r, new_events);
    if (r->from_scheduler && client_) {
      finished_unreported_.push_back(r);
    } else {
      erase(r);
    }
  }
  running_ = std::move(still);
  if (client_) {
    unacked_events_.insert(unacked_events_.end(), std::make_move_iterator(new_events.begin()),
                           std::make_move_iterator(new_events.end()));
    report_due_ = true;  // the reporter thread sends the new output
    report_cv_.notify_all();
  }
  return true;
}

bool SimEngine::report_locked(std::unique_lock<std::mutex>& lock, const std::vector<Request*>& starting) {
  report_cv_.wait(lock, [&] { return !reporting_; });
  reporting_ = true;
  std::vector<v1::RequestProgress> progress;
  std::vector<std::pair<std::string, uint32_t>> covered;  // request id, output size reported
  for (Request* r : starting) {
    v1::RequestProgress& p = progress.emplace_back();
    p.set_request_id(r->id);
    p.set_phase(v1::RequestProgress::STARTED);
    p.set_cached_tokens(static_cast<uint32_t>(
        std::min<uint64_t>(r->prompt.size(), uint64_t{r->cached_blocks} * o_.block_size)));
  }
  auto add_output = [&](Request* r) {
    if (!r->from_scheduler || r->cancelled) return;
    if (r->output.size() == r->acked_tokens && !r->finished) return;
    v1::RequestProgress& p = progress.emplace_back();
    p.set_request_id(r->id);
    p.set_phase(r->finished ? v1::RequestProgress::FINISHED : v1::RequestProgress::RUNNING);
    p.set_token_offset(r->acked_tokens);
    p.mutable_new_tokens()->Add(r->output.begin() + r->acked_tokens, r->output.end());
    if (r->finished) p.set_finish_reason("length");
    covered.push_back({r->id, static_cast<uint32_t>(r->output.size())});
  };
  for (Request* r : running_) add_output(r);
  for (Request* r : finished_unreported_) add_output(r);
  std::vector<v1::KvEvent> events = unacked_events_;
  if (!pending_evictions_.empty()) {
    v1::BlocksRemoved* rm = events.emplace_back().mutable_removed();
    rm->mutable_block_hashes()->Add(pending_evictions_.begin(), pending_evictions_.end());
  }
  const size_t evictions_sent = pending_evictions_.size(), events_sent = unacked_events_.size();
  const v1::EngineLoad load = load_locked();
  lock.unlock();
  const ReportResult res = client_->report(load, std::move(events), std::move(progress));
  lock.lock();
  if (res.status.ok()) {
    unacked_events_.erase(unacked_events_.begin(),
                          unacked_events_.begin() + static_cast<std::ptrdiff_t>(events_sent));
    pending_evictions_.erase(pending_evictions_.begin(),
                             pending_evictions_.begin() + static_cast<std::ptrdiff_t>(evictions_sent));
    // (Requests may have been dropped while the lock was released.)
    for (const auto& [id, n] : covered) {
      auto it = requests_.find(id);
      if (it != requests_.end()) it->second->acked_tokens = std::max(it->second->acked_tokens, n);
    }
    for (Request* r : starting) r->started = true;
    // Finished requests are done once their last output is acknowledged.
    std::vector<Request*> keep;
    for (Request* r : finished_unreported_) {
      if (r->cancelled || (r->finished && r->acked_tokens == r->output.size())) {
        erase(r);
      } else {
        keep.push_back(r);
      }
    }
    finished_unreported_ = std::move(keep);
  }
  reporting_ = false;
  report_cv_.notify_all();
  return res.status.ok();
}

void SimEngine::reporter() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    report_cv_.wait(lock, [&] { return stopping_ || report_due_; });
    if (stopping_) break;
    report_due_ = false;
    if (!report_locked(lock, {})) {
      report_due_ = true;  // retry, without spinning while the scheduler is away
      report_cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping_; });
    }
  }
}

std::vector<RequestRecord> SimEngine::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

std::vector<LoadSample> SimEngine::samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return samples_;
}

}  // namespace moelink::scheduler::sim
