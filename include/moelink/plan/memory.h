// moelink-plan: what one GPU holds: weights, KV cache, communication buffers.
#pragma once
#include <string>

#include "moelink/plan/hardware.h"
#include "moelink/plan/layout.h"
#include "moelink/plan/model.h"

namespace moelink::plan {

struct MemoryReport {
  double routed_expert_bytes = 0;
  double attention_bytes = 0;
  double shared_expert_bytes = 0;
  double dense_mlp_bytes = 0;
  double embedding_bytes = 0;
  double other_bytes = 0;        // router, norms, fp8 block scales
  double mtp_bytes = 0;          // MTP draft modules
  double weight_bytes = 0;       // sum of the above
  double kv_bytes_per_token = 0; // on this GPU
  double kv_bytes = 0;           // batch x kv_len x per token
  double buffer_bytes = 0;       // dispatch/combine receive buffers
  double reserve_bytes = 0;      // runtime reserve from the GPU profile
  double capacity_bytes = 0;     // usable HBM
  double used_bytes = 0;
  double free_bytes = 0;         // negative: does not fit
  int max_batch = 0;             // requests of kv_len per DP group that fit
  bool fits() const { return free_bytes >= 0; }
};

MemoryReport memory_report(const ModelSpec& m, const GpuProfile& gpu, const Layout& l,
                           const Workload& w);
// Throws PlanError saying by how much the layout overflows.
void require_fits(const MemoryReport& r, const Layout& l, const Workload& w, const std::string& gpu);

}  // namespace moelink::plan
