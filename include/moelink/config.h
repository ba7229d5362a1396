// Configuration of an AllToAll: the MoE shape and the parallel layout.
#pragma once

#include <cstdint>
#include <string>

#include "moelink/types.h"

namespace moelink {

struct Config {
  // Tokens per rank (per DP group) that one dispatch may carry: an upper bound
  // on bound_m. Sizes every buffer. 1..1,048,576.
  int64_t max_num_tokens = 0;
  // Total experts E. Divisible by world_size; expert e lives on rank e / L with
  // L = E / world_size local experts per rank. 1..65,536.
  int num_experts = 0;
  // Top-k routes per token, 1..16.
  int experts_per_token = 0;
  // Elements per token row; a multiple of 16 (rows move in 16-byte vectors).
  int64_t hidden_dim = 0;
  // fp32 scales per token (e.g. hidden_dim / 128 for 1x128 block scaling).
  // >= 1 when in_dtype is fp8, 0 otherwise.
  int hidden_dim_scale = 0;
  // Type of dispatched tokens: kFloat8E4M3, kBFloat16 or kFloat16.
  DType in_dtype = DType::kBFloat16;
  // Type of combined tokens: kBFloat16 or kFloat16.
  DType out_dtype = DType::kBFloat16;
  int rank = 0;
  int world_size = 1;
  // Ranks per data-parallel group: ranks r with equal r / dp_size hold the
  // same tokens (an attention tensor-parallel group). Divides world_size.
  int dp_size = 1;

  int num_local_experts() const { return world_size > 0 ? num_experts / world_size : 0; }
  int num_dp_groups() const { return dp_size > 0 ? world_size / dp_size : 0; }
  int dp_group() const { return dp_size > 0 ? rank / dp_size : 0; }
  // Rows per local expert in the batched-experts output layout.
  int64_t expert_capacity() const { return max_num_tokens * num_dp_groups(); }

  // Throws InvalidArgument naming the first field that breaks a rule, its
  // value and the rule.
  void validate() const;
  std::string to_string() const;
};

}  // namespace moelink
