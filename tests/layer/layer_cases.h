// MoELayer cases, run on forked ranks (rank_harness.h) on any backend:
// every rank builds the same random model from one fresh seed, takes its
// experts, runs forward() on its own tokens, and checks its rows against the
// fp64 reference (layer_reference.h); rows past m must stay poisoned.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moelink/moe_layer.h"

namespace moelink_test {

// Small models with each routing kind (H 256):
//   DeepSeekLike: 16 experts, top-4 in 2 of 4 groups, sigmoid, bias, one shared expert
//   MixtralLike: 8 experts, top-2, softmax, no shared expert
//   QwenLike: 16 experts, top-4, softmax, renormalized, no shared expert
moelink::MoEModelConfig deepseek_like_model();
moelink::MoEModelConfig mixtral_like_model();
moelink::MoEModelConfig qwen_like_model();

struct LayerCase {
  std::string name;
  moelink::MoEModelConfig model;
  moelink::Backend backend = moelink::Backend::kCPU;
  int world = 2;
  int dp_size = 1;
  int64_t max_tokens = 24;
  moelink::MoEOverlap overlap = moelink::MoEOverlap::kAuto;
  bool cuda_graphs = false;
  int rounds = 2;  // forward() calls, each with new tokens and m
  // forward()'s num_tokens: m itself (the host knows it: smaller graph
  // buckets, and the decode-sized shared expert at <= 32 rows) instead of T.
  bool num_tokens_is_m = false;
  // Expert 0's e_score_correction_bias raised so that every token picks it:
  // more routes to one expert than a micro-batch has tokens.
  bool one_hot_expert = false;
  // m of each round (replaces `rounds`; rank r of DP group g takes entry
  // (round + g) mod size), with x and out holding max(m, 1) rows: tiny and
  // empty batches, one-token micro-batches. Empty: T rows, random m.
  std::vector<int32_t> ms;
  // Before each round's call: one refused on the host (out of the wrong
  // dtype) and one with bound_m past x's rows, whose check() must report
  // it; the good call after them must run and check() clean.
  bool bad_calls = false;
  // The router weight given in fp32 (the same values as the bf16 one).
  bool fp32_gate = false;
  // A second layer created with share_with = the first (MoELayer::create),
  // its own weights, called after the first each round: both must match
  // their references.
  bool shared_scratch = false;
  // The layer in stages instead of forward(): each round's m tokens split
  // into two micro-batches (part 0: the first min(m, ceil(T / 2)) rows, part
  // 1: the rest) with their own x, out and bound_m views, their
  // stage_begin / stage_middle / stage_end interleaved (two orders,
  // alternating by round).
  bool stages = false;
};

// Every overlap mode on worlds 1, 2 and 4 (and DP 2) for the three models.
std::vector<LayerCase> layer_cases(moelink::Backend backend);

void run_layer_case(const LayerCase& c);

}  // namespace moelink_test
