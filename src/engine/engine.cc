#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>

#include "moelink/errors.h"

namespace moelink::engine {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
    case FinishReason::kHandedOff: return "handed_off";
  }
  return "";
}

Engine::Engine(Model& model, KvCacheManager& kv, const EngineOptions& options)
    : model_(model), kv_(kv), o_(options) {
  auto bad = [](const char* field, int64_t v, const std::string& rule) {
    throw std::invalid_argument("moelink: EngineOptions." + std::string(field) + " = " +
                                std::to_string(v) + " " + rule);
  };
  if (o_.token_budget < 1) bad("token_budget", o_.token_budget, "must be >= 1");
  if (o_.max_running < 1) bad("max_running", o_.max_running, "must be >= 1");
  if (o_.max_pages_per_request < 1) bad("max_pages_per_request", o_.max_pages_per_request, "must be >= 1");
  if (o_.speculative && !model_.mtp())
    throw std::invalid_argument("moelink: EngineOptions.speculative needs a model created with ModelOptions.mtp "
                                "(its MTP module proposes the drafts)");
}

void Engine::check_params(const GenerateParams& p) const {
  auto bad = [](const char* field, const std::string& what) {
    throw std::invalid_argument("moelink: Engine.add: " + std::string(field) + " " + what);
  };
  if (p.prompt.empty()) bad("prompt", "is empty (at least one token)");
  if (p.max_tokens < 1) bad("max_tokens", "= " + std::to_string(p.max_tokens) + " must be >= 1");
  const int64_t room = int64_t{o_.max_pages_per_request} * kv_.page_size();
  if (static_cast<int64_t>(p.prompt.size()) + p.max_tokens > room)
    bad("max_tokens", "= " + std::to_string(p.max_tokens) + " with a prompt of " +
                          std::to_string(p.prompt.size()) + " tokens exceeds the " +
                          std::to_string(room) + " tokens a request may hold (max_pages_per_request * page_size)");
  const uint32_t vocab = static_cast<uint32_t>(model_.config().vocab_size);
  for (size_t i = 0; i < p.prompt.size(); ++i)
    if (p.prompt[i] >= vocab)
      bad("prompt", "token " + std::to_string(i) + " = " + std::to_string(p.prompt[i]) +
                        " is outside [0, " + std::to_string(vocab) + ") (vocab_size)");
  if (!(p.temperature >= 0.0f)) bad("temperature", "= " + std::to_string(p.temperature) + " must be >= 0");
  if (p.top_k < 0) bad("top_k", "= " + std::to_string(p.top_k) + " must be >= 0");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) bad("top_p", "= " + std::to_string(p.top_p) + " must be in (0, 1]");
}

void Engine::check_usable(const char* call) const {
  if (!failure_.empty())
    throw SystemError(std::string("moelink: Engine.") + call + ": the model failed at an earlier step and " +
                      "cannot run again (" + failure_ + "); start a new engine on a new model");
}

uint64_t Engine::add(const GenerateParams& p) {
  check_usable("add");
  check_params(p);
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->params = p;
  r->tokens = p.prompt;
  r->prompt_len = static_cast<int64_t>(p.prompt.size());
  waiting_.push_back(r.get());
  const uint64_t id = r->id;
  requests_[id] = std::move(r);
  return id;
}

void Engine::release(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || !it->second->handed_off) return;
  kv_.release(id);
  requests_.erase(it);
}

std::optional<Engine::Received> Engine::receive(const GenerateParams& p) {
  check_usable("receive");
  check_params(p);
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->params = p;
  r->params.hand_off = false;
  r->tokens = p.prompt;
  r->prompt_len = static_cast<int64_t>(p.prompt.size());
  r->cached = kv_.admit(r->id, p.prompt);
  if (!kv_.reserve(r->id, r->prompt_len)) {
    kv_.release(r->id);
    return std::nullopt;
  }
  r->started = r->awaiting_kv = r->reported_cache = true;
  Received out{r->id, r->cached, kv_.pages(r->id)};
  requests_[r->id] = std::move(r);
  return out;
}

void Engine::resume(uint64_t id, uint32_t first_token) {
  auto it = requests_.find(id);
  if (it == requests_.end() || !it->second->awaiting_kv)
    throw std::invalid_argument("moelink: Engine.resume: request " + std::to_string(id) +
                                " is not waiting for its KV rows (receive() it first)");
  Request& r = *it->second;
  r.awaiting_kv = false;
  r.computed = r.prompt_len;
  kv_.commit(r.id, r.tokens, r.computed);
  r.tokens.push_back(first_token);
  r.output = 1;
  resumed_.push_back(&r);
}

void Engine::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it != requests_.end()) it->second->cancelled = true;
}

void Engine::preempt(Request& r) {
  // Recompute later: its prompt and what it made so far become the prompt.
  kv_.release(r.id);
  r.computed = 0;
  r.started = false;
  r.draft = -1;
  r.prompt_len = static_cast<int64_t>(r.tokens.size());
  running_.erase(std::find(running_.begin(), running_.end(), &r));
  waiting_.push_front(&r);
  ++preemptions_;
}

// The step's result for request `id`, appended when it has none yet (a
// reference until the next append).
static StepResult& result_of(std::vector<StepResult>& out, uint64_t id) {
  auto it = std::find_if(out.begin(), out.end(), [&](const StepResult& s) { return s.id == id; });
  if (it == out.end()) it = out.insert(out.end(), StepResult{id, {}, FinishReason::kNone, 0, {}});
  return *it;
}

void Engine::finish(Request& r, FinishReason why, std::vector<StepResult>& out) {
  kv_.release(r.id);
  running_.erase(std::remove(running_.begin(), running_.end(), &r), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &r), waiting_.end());
  resumed_.erase(std::remove(resumed_.begin(), resumed_.end(), &r), resumed_.end());
  result_of(out, r.id).finished = why;
  requests_.erase(r.id);
}

bool Engine::emit(Request& r, uint32_t t, StepResult& result, std::vector<StepResult>& out) {
  r.tokens.push_back(t);
  ++r.output;
  result.tokens.push_back(t);
  const auto& stops = r.params.stop_tokens;
  if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
    finish(r, FinishReason::kStop, out);
    return true;
  }
  if (r.output >= static_cast<size_t>(r.params.max_tokens)) {
    finish(r, FinishReason::kLength, out);
    return true;
  }
  return false;
}

void Engine::fail(const std::string& error, std::vector<StepResult>& out) {
  failure_ = error;
  std::vector<Request*> all;
  for (auto& [id, r] : requests_) all.push_back(r.get());
  for (Request* r : all) {
    result_of(out, r->id).error = error;
    finish(*r, FinishReason::kError, out);
  }
}

std::vector<StepResult> Engine::step() {
  std::vector<StepResult> out;
  if (!failure_.empty()) return out;  // every request ended when the model failed
  // Cancelled requests end now.
  std::vector<Request*> gone;
  for (auto& [id, r] : requests_)
    if (r->cancelled) gone.push_back(r.get());
  for (Request* r : gone) finish(*r, FinishReason::kCancelled, out);

  // Resumed requests (their prompt's KV came from a prefill engine) join
  // the running decodes as room allows; one whose first token already
  // ends it (a stop token, max_tokens 1) ends here.
  while (!resumed_.empty() && running_.size() < static_cast<size_t>(o_.max_running)) {
    Request& r = *resumed_.front();
    resumed_.pop_front();
    const auto& stops = r.params.stop_tokens;
    if (std::find(stops.begin(), stops.end(), r.tokens.back()) != stops.end())
      finish(r, FinishReason::kStop, out);
    else if (r.output >= static_cast<size_t>(r.params.max_tokens))
      finish(r, FinishReason::kLength, out);
    else
      running_.push_back(&r);
  }

  // ---- schedule
  std::vector<Planned> decodes, prefills;
  int64_t budget = o_.token_budget;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request& r = *running_[i];
    if (r.computed < r.prompt_len) {
      ++i;
      continue;
    }
    // A draft rides along when it fits the budget and max_tokens (an
    // accepted draft and the token after it are two outputs).
    const int64_t q_len = o_.speculative && r.draft >= 0 && budget >= 2 &&
                                  r.output + 2 <= static_cast<size_t>(r.params.max_tokens)
                              ? 2
                              : 1;
    bool preempted_self = false;
    while (!kv_.reserve(r.id, r.computed + q_len)) {
      Request& victim = *running_.back();  // the most recently started
      preempt(victim);
      if (&victim == &r) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;
    decodes.push_back({&r, q_len});
    budget -= q_len;
    ++i;
  }
  auto batch_full = [&] { return decodes.size() + prefills.size() >= static_cast<size_t>(o_.max_running); };
  for (Request* rp : running_) {
    Request& r = *rp;
    if (budget <= 0 || batch_full()) break;
    if (r.computed >= r.prompt_len) continue;
    const int64_t chunk = std::min(r.prompt_len - r.computed, budget);
    if (!kv_.reserve(r.id, r.computed + chunk)) break;
    prefills.push_back({&r, chunk});
    budget -= chunk;
  }
  while (budget > 0 && !waiting_.empty() && !batch_full() &&
         running_.size() < static_cast<size_t>(o_.max_running)) {
    Request& r = *waiting_.front();
    const std::span<const uint32_t> prompt(r.tokens.data(), static_cast<size_t>(r.prompt_len));
    r.cached = kv_.admit(r.id, prompt);
    r.computed = r.cached;
    const int64_t chunk = std::min(r.prompt_len - r.computed, budget);
    if (!kv_.reserve(r.id, r.computed + chunk)) {
      kv_.release(r.id);  // nothing taken: it waits for pages
      r.computed = 0;
      break;
    }
    r.started = true;
    waiting_.pop_front();
    running_.push_back(&r);
    prefills.push_back({&r, chunk});
    budget -= chunk;
  }

  // ---- run
  std::vector<Planned> batch = decodes;
  batch.insert(batch.end(), prefills.begin(), prefills.end());
  const int B = static_cast<int>(batch.size());
  std::vector<int32_t> token_ids, q_start{0}, kv_len, top_k, num_drafts, known_next;
  std::vector<float> temperature, top_p;
  std::vector<int64_t> seed;
  int64_t columns = 1;
  for (const Planned& p : batch) {
    const Request& r = *p.r;
    const bool drafted = r.computed + p.q_len > static_cast<int64_t>(r.tokens.size());  // its last row: the draft
    for (int64_t t = r.computed; t < r.computed + p.q_len - (drafted ? 1 : 0); ++t)
      token_ids.push_back(static_cast<int32_t>(r.tokens[t]));
    if (drafted) token_ids.push_back(r.draft);
    num_drafts.push_back(drafted ? 1 : 0);
    // The token after a prefill chunk that does not end the prompt (the MTP
    // module's input there).
    const int64_t after = r.computed + p.q_len;
    known_next.push_back(!drafted && after < static_cast<int64_t>(r.tokens.size())
                             ? static_cast<int32_t>(r.tokens[after])
                             : -1);
    q_start.push_back(q_start.back() + static_cast<int32_t>(p.q_len));
    kv_len.push_back(static_cast<int32_t>(r.computed + p.q_len));
    temperature.push_back(r.params.temperature);
    top_k.push_back(r.params.top_k);
    top_p.push_back(r.params.top_p);
    seed.push_back(r.params.seed);
    columns = std::max<int64_t>(columns, static_cast<int64_t>(kv_.pages(r.id).size()));
  }
  std::vector<int32_t> table(static_cast<size_t>(std::max(B, 1) * columns), 0);
  for (int i = 0; i < B; ++i) {
    const std::vector<int32_t>& pages = kv_.pages(batch[i].r->id);
    std::copy(pages.begin(), pages.end(), table.begin() + i * columns);
  }
  std::vector<int32_t> next(std::max(B, 1), -1), accepted(std::max(B, 1), 0), drafts(std::max(B, 1), -1);
  StepInput in;
  const int64_t n = static_cast<int64_t>(token_ids.size());
  in.token_ids = Tensor::contiguous(token_ids.data(), DType::kInt32, {n});
  in.batch.num_requests = B;
  in.batch.num_decode = static_cast<int>(decodes.size());
  in.batch.q_start = Tensor::contiguous(q_start.data(), DType::kInt32, {B + 1});
  if (B > 0) {
    in.batch.kv_len = Tensor::contiguous(kv_len.data(), DType::kInt32, {B});
    in.batch.block_table = Tensor::contiguous(table.data(), DType::kInt32, {B, columns});
    in.sampling.temperature = Tensor::contiguous(temperature.data(), DType::kFloat32, {B});
    in.sampling.top_k = Tensor::contiguous(top_k.data(), DType::kInt32, {B});
    in.sampling.top_p = Tensor::contiguous(top_p.data(), DType::kFloat32, {B});
    in.sampling.seed = Tensor::contiguous(seed.data(), DType::kInt64, {B});
    if (o_.speculative) {
      in.num_drafts = Tensor::contiguous(num_drafts.data(), DType::kInt32, {B});
      in.known_next = Tensor::contiguous(known_next.data(), DType::kInt32, {B});
    }
  }
  StepOutput so;
  so.next_tokens = Tensor::contiguous(next.data(), DType::kInt32, {B});
  if (o_.speculative) {
    so.accepted = Tensor::contiguous(accepted.data(), DType::kInt32, {B});
    so.draft_tokens = Tensor::contiguous(drafts.data(), DType::kInt32, {B});
  }
  std::string error;
  bool fatal = false;  // the model cannot run again (a device error, a peer gone)
  const auto t0 = std::chrono::steady_clock::now();
  try {
    model_.step_from_host(in, so);
    model_.check();
  } catch (const SystemError& e) {
    error = e.what();
    fatal = true;
  } catch (const TimeoutError& e) {
    error = e.what();
    fatal = true;
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++step_times_.steps;
  step_times_.seconds += seconds;
  if (B > 0 && prefills.empty()) {
    ++step_times_.decode_steps;
    step_times_.decode_requests += B;
    step_times_.decode_seconds += seconds;
  }

  // ---- process
  for (int i = 0; i < B; ++i) {
    Request& r = *batch[i].r;
    StepResult& result = result_of(out, r.id);
    if (!r.reported_cache) {
      result.cached_tokens = r.cached;
      r.reported_cache = true;
    }
    if (!error.empty()) {
      result.error = error;
      finish(r, FinishReason::kError, out);
      continue;
    }
    if (num_drafts[i] > 0) {
      // The draft's row holds valid KV only when it was accepted; a
      // rejected one is overwritten by the next step.
      ++drafts_proposed_;
      drafts_accepted_ += accepted[i];
      r.computed += 1 + accepted[i];
      const uint32_t draft = static_cast<uint32_t>(r.draft);
      r.draft = drafts[i];
      if (accepted[i] > 0 && emit(r, draft, result, out)) continue;
      kv_.commit(r.id, r.tokens, r.computed);
      emit(r, static_cast<uint32_t>(next[i]), result, out);
      continue;
    }
    r.computed += batch[i].q_len;
    kv_.commit(r.id, r.tokens, r.computed);
    if (r.computed < static_cast<int64_t>(r.tokens.size())) continue;  // a prefill chunk mid-prompt
    r.draft = o_.speculative ? drafts[i] : -1;
    if (emit(r, static_cast<uint32_t>(next[i]), result, out) || !r.params.hand_off) continue;
    // P/D prefill side: the pages stay held for the decode engine.
    r.handed_off = true;
    running_.erase(std::find(running_.begin(), running_.end(), &r));
    result.finished = FinishReason::kHandedOff;
  }
  if (fatal) fail(error, out);  // the batch's requests ended above, the rest end here
  return out;
}

}  // namespace moelink::engine
