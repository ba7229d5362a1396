#include "scheduler/core/validate.h"

#include <cmath>

#include "scheduler/core/scheduler_core.h"

namespace moelink::scheduler {

using grpc::Status;
using grpc::StatusCode;

bool is_valid_id(const std::string& id, size_t max_len) {
  if (id.empty() || id.size() > max_len) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

namespace {

Status invalid(const std::string& msg) { return Status(StatusCode::INVALID_ARGUMENT, msg); }

std::string quoted(const std::string& s) {
  return "'" + (s.size() > 80 ? s.substr(0, 80) + "..." : s) + "'";
}

}  // namespace

Status validate_engine_info(const v1::EngineInfo& info, uint32_t block_size) {
  if (!is_valid_id(info.engine_id(), 64))
    return invalid("engine.engine_id " + quoted(info.engine_id()) +
                   " must be 1..64 characters of [A-Za-z0-9._:-]");
  if (info.block_size() != block_size)
    return Status(StatusCode::FAILED_PRECONDITION,
                  "engine.block_size " + std::to_string(info.block_size()) + " of engine '" +
                      info.engine_id() + "' does not match the scheduler's block size " +
                      std::to_string(block_size) + " (--block-size)");
  if (info.kv_capacity_blocks() == 0 || info.kv_capacity_blocks() > (1ull << 40))
    return invalid("engine.kv_capacity_blocks " + std::to_string(info.kv_capacity_blocks()) +
                   " is outside 1..2^40");
  if (info.max_batch() == 0 || info.max_batch() > (1u << 20))
    return invalid("engine.max_batch " + std::to_string(info.max_batch()) + " is outside 1..1048576");
  if (info.address().size() > 256)
    return invalid("engine.address is " + std::to_string(info.address().size()) +
                   " characters long; at most 256");
  if (!std::isfinite(info.prefill_us_per_token()) || info.prefill_us_per_token() < 0 ||
      info.prefill_us_per_token() > 1e9)
    return invalid("engine.prefill_us_per_token " + std::to_string(info.prefill_us_per_token()) +
                   " is outside 0..1e9 (0: the scheduler's default)");
  if (!std::isfinite(info.decode_step_us()) || info.decode_step_us() < 0 ||
      info.decode_step_us() > 1e9)
    return invalid("engine.decode_step_us " + std::to_string(info.decode_step_us()) +
                   " is outside 0..1e9 (0: the scheduler's default)");
  if (!v1::EngineRole_IsValid(info.role()))
    return invalid("engine.role " + std::to_string(info.role()) +
                   " is not ROLE_MIXED (0), ROLE_PREFILL (1) or ROLE_DECODE (2)");
  if (info.role() == v1::ROLE_DECODE && info.handoff_address().empty())
    return invalid("engine.handoff_address is empty; a ROLE_DECODE engine must say where prefill "
                   "engines reach its KV hand-off service (host:port)");
  if (info.handoff_address().size() > 256)
    return invalid("engine.handoff_address is " + std::to_string(info.handoff_address().size()) +
                   " characters long; at most 256");
  return Status::OK;
}

Status validate_generate(const v1::GenerateRequest& req, const SchedulerOptions& options) {
  if (!req.request_id().empty() && !is_valid_id(req.request_id(), 128))
    return invalid("request_id " + quoted(req.request_id()) +
                   " must be 1..128 characters of [A-Za-z0-9._:-] (or empty: the scheduler names it)");
  if (req.prompt_tokens_size() == 0)
    return invalid("prompt_tokens is empty; send 1.." + std::to_string(options.max_prompt_tokens) +
                   " token ids (a client with text applies its tokenizer first)");
  if (static_cast<uint64_t>(req.prompt_tokens_size()) > options.max_prompt_tokens)
    return Status(StatusCode::OUT_OF_RANGE,
                  "prompt_tokens has " + std::to_string(req.prompt_tokens_size()) +
                      " tokens; the limit is " + std::to_string(options.max_prompt_tokens) +
                      " (--max-prompt-tokens)");
  const uint32_t n = req.sampling().max_new_tokens();
  if (n == 0 || n > options.max_new_tokens)
    return Status(StatusCode::OUT_OF_RANGE,
                  "sampling.max_new_tokens " + std::to_string(n) + " is outside 1.." +
                      std::to_string(options.max_new_tokens) + " (--max-new-tokens)");
  if (!std::isfinite(req.sampling().temperature()) || req.sampling().temperature() < 0)
    return invalid("sampling.temperature " + std::to_string(req.sampling().temperature()) +
                   " must be a finite number >= 0");
  if (req.session_id().size() > 256)
    return invalid("session_id is " + std::to_string(req.session_id().size()) +
                   " characters long; at most 256");
  if (req.stream_interval() > 4096)
    return invalid("stream_interval " + std::to_string(req.stream_interval()) + " is outside 0..4096");
  return Status::OK;
}

}  // namespace moelink::scheduler
