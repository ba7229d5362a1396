// Checks of what engines and clients send, before anything is changed. Each
// error names the field, the value and what is allowed.
#pragma once
#include <google/protobuf/repeated_field.h>
#include <grpcpp/support/status.h>

#include <span>
#include <string>

#include "moelink/scheduler/v1/scheduler.pb.h"

namespace moelink::scheduler {

struct SchedulerOptions;

inline std::span<const uint32_t> tokens_of(const google::protobuf::RepeatedField<uint32_t>& f) {
  return {f.data(), static_cast<size_t>(f.size())};
}

// 1..max_len characters of [A-Za-z0-9._:-].
bool is_valid_id(const std::string& id, size_t max_len);

grpc::Status validate_engine_info(const v1::EngineInfo& info, uint32_t block_size);
grpc::Status validate_generate(const v1::GenerateRequest& req, const SchedulerOptions& options);

}  // namespace moelink::scheduler
