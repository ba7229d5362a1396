// moelink-plan: parallel layout and decode workload.
#pragma once
#include <string>

#include "moelink/plan/hardware.h"
#include "moelink/plan/model.h"

namespace moelink::plan {

enum class OverlapMode { kNone, kDispatchOverlap, kMicroBatch };
const char* to_string(OverlapMode m);
OverlapMode overlap_from_string(const std::string& s);  // none | dispatch | microbatch

// EP = DP x TP GPUs. Attention runs in DP groups of TP GPUs (MLA weights and KV
// replicated inside a group, heads split); the MoE layers use all EP GPUs.
struct Layout {
  int ep = 8;
  int dp = 8;
  int tp = 1;
  int gpus_per_node = 8;
  int gpus() const { return ep; }
  int nodes() const { return (ep + gpus_per_node - 1) / gpus_per_node; }
  std::string str() const;  // "EP128 DP32 TP4"
};

struct Workload {
  int batch = 1;          // requests per DP group (= per GPU at TP1)
  int kv_len = 5000;      // tokens in each request's KV cache
  int draft_tokens = 1;   // MTP draft tokens per step (query length = 1 + draft)
  double acceptance = 0.6;
  OverlapMode overlap = OverlapMode::kDispatchOverlap;
  int query_len() const { return 1 + draft_tokens; }
  // Expected tokens a request emits per step: 1 + a + a^2 + ... + a^draft.
  double tokens_per_step() const;
};

// Why no layout with this EP size can serve the model over the network ("" when
// some can): the experts must split evenly, and an NVLink-only network cannot
// span nodes. Sweeps use it to leave out a whole EP size with one reason.
std::string ep_problem(int ep, int gpus_per_node, const ModelSpec& m, const NetworkProfile& net);
// Why the layout cannot serve the model ("" when it can): ep_problem plus the
// DP x TP split (TP must divide EP and the heads, and fit in one node).
std::string layout_problem(const Layout& l, const ModelSpec& m, const NetworkProfile& net);
// Throws PlanError ("layout EP.. DP.. TP..: <layout_problem>") when the layout is invalid.
void validate(const Layout& l, const ModelSpec& m, const NetworkProfile& net);

}  // namespace moelink::plan
