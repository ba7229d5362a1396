#include "moelink/plan/layout.h"

#include <cmath>

namespace moelink::plan {

const char* to_string(OverlapMode m) {
  switch (m) {
    case OverlapMode::kNone: return "none";
    case OverlapMode::kDispatchOverlap: return "dispatch";
    case OverlapMode::kMicroBatch: return "microbatch";
  }
  return "?";
}

OverlapMode overlap_from_string(const std::string& s) {
  if (s == "none" || s == "no") return OverlapMode::kNone;
  if (s == "dispatch" || s == "dispatch-overlap") return OverlapMode::kDispatchOverlap;
  if (s == "microbatch" || s == "two-microbatch" || s == "mb") return OverlapMode::kMicroBatch;
  throw PlanError("unknown overlap mode '" + s + "'; valid: none, dispatch, microbatch");
}

std::string Layout::str() const {
  return "EP" + std::to_string(ep) + " DP" + std::to_string(dp) + " TP" + std::to_string(tp);
}

double Workload::tokens_per_step() const {
  double t = 0, p = 1;
  for (int i = 0; i <= draft_tokens; ++i, p *= acceptance) t += p;
  return t;
}

void validate(const Layout& l, const ModelSpec& m, const NetworkProfile& net) {
  auto bad = [&](const std::string& why) { throw PlanError("layout " + l.str() + ": " + why); };
  if (l.ep < 1 || l.dp < 1 || l.tp < 1 || l.gpus_per_node < 1) bad("EP, DP, TP and GPUs per node must be >= 1");
  if (l.dp * l.tp != l.ep) bad("EP must equal DP x TP");
  if (l.tp > l.gpus_per_node) bad("a TP group must fit in one node (TP <= " + std::to_string(l.gpus_per_node) + ")");
  if (m.num_experts % l.ep != 0)
    bad("EP must divide the " + std::to_string(m.num_experts) + " experts of " + m.name);
  if (m.num_heads % l.tp != 0) bad("TP must divide the " + std::to_string(m.num_heads) + " attention heads");
  if (l.ep > l.gpus_per_node && !net.inter_node)
    bad("spans " + std::to_string(l.nodes()) + " nodes but network '" + net.name +
        "' is NVLink only (at most " + std::to_string(l.gpus_per_node) + " GPUs)");
}

}  // namespace moelink::plan
