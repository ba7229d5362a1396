// Engine: continuous batching over a Model and a KvCacheManager, one step()
// at a time (the loop's schedule, run, process-outputs):
//
//   schedule  running decodes first (one token each; when pages run out the
//             most recently started request is preempted: its pages are
//             released and it waits to be recomputed from its prompt and
//             the tokens it made), then prefill chunks of waiting or
//             partly prefilled requests within the step's token budget
//             (prefix-cached pages are skipped);
//   run       Model::step over the batch (decodes first, as MLABatch wants);
//   process   the computed pages committed to the cache, each request's new
//             tokens appended, stop conditions (a stop token, max_tokens)
//             applied, finished and cancelled requests released.
//
// Speculative decoding (EngineOptions.speculative, a model with MTP): a
// decode carries the draft the model proposed at its last step as a second
// row; the step accepts it when it is the token the model picks anyway, so
// a request then gains two tokens in one step and its output is the same
// as without drafts.
//
// Prefill/decode disaggregation: a prefill engine runs a request with
// hand_off set up to its first token, then holds its pages (finish reason
// "handed_off") until release(); a decode engine receive()s the request
// (pages reserved for its prompt, prefix-cached ones shared), the caller
// moves the prompt's KV rows into those pages (the TransferEngine), and
// resume() continues decoding after the first token.
//
// Every rank of an expert-parallel model runs an Engine over its own
// requests and calls step() in lock step with the others (a step without
// requests still takes part in the MoE layers' exchanges).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/kv_cache_manager.h"
#include "moelink/model.h"

namespace moelink::engine {

struct EngineOptions {
  int64_t token_budget = 0;  // query tokens a step may carry (<= the model's max_tokens)
  int max_running = 0;       // requests a step may carry (<= the attention's max_requests)
  int max_pages_per_request = 0;  // the block table's columns (the attention's option)
  bool speculative = false;       // verify the model's MTP drafts (needs ModelOptions.mtp)
};

struct GenerateParams {
  std::vector<uint32_t> prompt;      // >= 1 token
  int max_tokens = 16;               // >= 1 generated tokens
  float temperature = 0.0f;          // 0: greedy
  int top_k = 0;
  float top_p = 1.0f;
  int64_t seed = 0;
  std::vector<uint32_t> stop_tokens;  // e.g. EOS; the stop token is part of the output
  // Prefill side of P/D disaggregation: stop after the first token and hold
  // the pages for a decode engine to fetch (FinishReason::kHandedOff).
  bool hand_off = false;
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError, kHandedOff };
// "", "stop", "length", "cancelled", "error", "handed_off"
const char* finish_reason_name(FinishReason r);

// What one step produced for one request.
struct StepResult {
  uint64_t id = 0;
  std::vector<uint32_t> tokens;  // new output tokens (0, 1, or 2 with an accepted draft)
  FinishReason finished = FinishReason::kNone;
  int64_t cached_tokens = 0;     // prompt tokens the prefix cache held (on its first step)
  std::string error;             // kError: why
};

class Engine {
 public:
  Engine(Model& model, KvCacheManager& kv, const EngineOptions& options);

  // Queues a request; returns its id. Throws std::invalid_argument naming
  // the field for an empty prompt, max_tokens < 1, a prompt plus max_tokens
  // beyond the pages a request may hold, or bad sampling values.
  uint64_t add(const GenerateParams& params);
  // Ends a request at the next step (its pages are freed then); unknown ids
  // are ignored.
  void cancel(uint64_t id);

  // P/D, prefill side: frees the pages of a request that finished with
  // kHandedOff (its KV rows were read); unknown ids are ignored.
  void release(uint64_t id);

  // P/D, decode side: a request whose prompt a prefill engine computed.
  // Admits it (prefix-cached pages shared) and reserves pages for its
  // prompt; returns its id, the prompt tokens the cache already holds
  // (their pages need no transfer: a multiple of page_size) and its pages
  // in token order. Nullopt when the pages do not suffice now (nothing
  // taken). The request waits until resume() (or cancel()). Checks params
  // as add() does.
  struct Received {
    uint64_t id = 0;
    int64_t cached_tokens = 0;
    std::vector<int32_t> pages;
  };
  std::optional<Received> receive(const GenerateParams& params);
  // The prompt's KV rows are in the pages: decoding continues after
  // `first_token` (the prefill engine's, already reported there; not
  // reported again). Throws std::invalid_argument for an id not waiting
  // for its KV.
  void resume(uint64_t id, uint32_t first_token);

  // One schedule-run-process round. Returns what changed per request.
  std::vector<StepResult> step();

  bool idle() const { return waiting_.empty() && running_.empty() && resumed_.empty(); }
  size_t waiting() const { return waiting_.size(); }
  size_t running() const { return running_.size(); }
  int64_t preemptions() const { return preemptions_; }
  // Drafts sent for verification and those accepted (speculative).
  int64_t drafts_proposed() const { return drafts_proposed_; }
  int64_t drafts_accepted() const { return drafts_accepted_; }

  // The model's steps inside step() (host clock around Model::step_from_host
  // and check(), which wait for the device): all of them, and the
  // decode-only ones (every request decoding) with the requests they
  // carried. The server's overhead is the rest of its loop.
  struct StepTimes {
    int64_t steps = 0, decode_steps = 0, decode_requests = 0;
    double seconds = 0.0, decode_seconds = 0.0;
  };
  const StepTimes& step_times() const { return step_times_; }
  // Empty while the engine serves. A step whose model failed in a way it
  // cannot run again after (SystemError: a CUDA error such as an illegal
  // address, which poisons the context; TimeoutError: a peer rank gone)
  // ends every request with kError and that message, which stays here:
  // step() does nothing more and add() / receive() throw SystemError. (Bad
  // batch values, InputError, end only that step's requests.)
  const std::string& failure() const { return failure_; }

 private:
  struct Request {
    uint64_t id = 0;
    GenerateParams params;
    std::vector<uint32_t> tokens;  // prompt, then the output so far
    int64_t computed = 0;          // tokens whose KV rows are in the cache
    int64_t prompt_len = 0;        // the prompt (grows on preemption: recompute)
    size_t output = 0;             // output tokens made
    bool started = false, cancelled = false, reported_cache = false;
    bool awaiting_kv = false;      // received, its KV rows not yet in (P/D decode side)
    bool handed_off = false;       // prefilled and held for a decode engine (P/D prefill side)
    int64_t cached = 0;
    int32_t draft = -1;            // the model's proposal for the token after the last one
  };
  struct Planned {
    Request* r;
    int64_t q_len;  // a decode with a draft: 2
  };

  void preempt(Request& r);
  void check_params(const GenerateParams& p) const;
  void finish(Request& r, FinishReason why, std::vector<StepResult>& out);
  void check_usable(const char* call) const;
  // Ends every request with kError (the model cannot run again).
  void fail(const std::string& error, std::vector<StepResult>& out);
  // Appends a new output token; true when it ends the request.
  bool emit(Request& r, uint32_t t, StepResult& result, std::vector<StepResult>& out);

  Model& model_;
  KvCacheManager& kv_;
  EngineOptions o_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;   // FIFO; preempted ones go to the front
  std::vector<Request*> running_;  // in admission order
  std::deque<Request*> resumed_;   // received and resumed, until running_ has room
  int64_t preemptions_ = 0, drafts_proposed_ = 0, drafts_accepted_ = 0;
  StepTimes step_times_;
  std::string failure_;
};

}  // namespace moelink::engine
