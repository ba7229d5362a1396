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

std::string ep_problem(int ep, int gpus_per_node, const ModelSpec& m, const NetworkProfile& net) {
  if (ep < 1 || gpus_per_node < 1) return "EP and GPUs per node must be >= 1";
  if (m.num_experts % ep != 0)
    return "the " + std::to_string(m.num_experts) + " experts of " + m.name + " are not divisible by EP " +
           std::to_string(ep) + " (EP must divide them)";
  if (ep > gpus_per_node && !net.inter_node) {
    const int nodes = (ep + gpus_per_node - 1) / gpus_per_node;
    return "spans " + std::to_string(nodes) + " nodes but network '" + net.name + "' is NVLink only (at most " +
           std::to_string(gpus_per_node) + " GPUs)";
  }
  return "";
}

std::string layout_problem(const Layout& l, const ModelSpec& m, const NetworkProfile& net) {
  if (l.ep < 1 || l.tp < 1 || l.gpus_per_node < 1) return "EP, TP and GPUs per node must be >= 1";
  if (l.ep % l.tp != 0) return "TP " + std::to_string(l.tp) + " does not divide EP " + std::to_string(l.ep);
  if (l.dp < 1 || l.dp * l.tp != l.ep) return "EP must equal DP x TP";
  if (l.tp > l.gpus_per_node)
    return "a TP group must fit in one node (TP <= " + std::to_string(l.gpus_per_node) + ")";
  if (m.num_heads % l.tp != 0)
    return "TP " + std::to_string(l.tp) + " does not divide the " + std::to_string(m.num_heads) + " attention heads";
  return ep_problem(l.ep, l.gpus_per_node, m, net);
}

void validate(const Layout& l, const ModelSpec& m, const NetworkProfile& net) {
  const std::string why = layout_problem(l, m, net);
  if (!why.empty()) throw PlanError("layout " + l.str() + ": " + why);
}

}  // namespace moelink::plan
