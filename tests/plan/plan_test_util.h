// Shared helpers of the planner tests: the profile tree of the source checkout.
#pragma once
#include "moelink/plan/profiles.h"
#include "moelink/plan/step.h"

namespace moelink::plan::test {
inline ProfileStore store() { return ProfileStore(std::string(MOELINK_SOURCE_DIR) + "/profiles"); }
inline PlanInput input(const std::string& model, const std::string& gpu, const std::string& net, Layout l,
                       int batch, OverlapMode ov = OverlapMode::kDispatchOverlap) {
  auto s = store();
  PlanInput in{s.model(model), s.gpu(gpu), s.network(net), l, {}};
  in.work.batch = batch;
  in.work.overlap = ov;
  return in;
}
}  // namespace moelink::plan::test
