#include "moelink/plan/hardware.h"

#include <nlohmann/json.hpp>

#include "moelink/plan/model.h"

namespace moelink::plan {
namespace {
using nlohmann::json;

json parse(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    throw PlanError(what + ": not valid JSON: " + e.what());
  }
}

double need(const json& j, const char* key, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number() || it->get<double>() < 0)
    throw PlanError(what + ": needs a non-negative number \"" + key + "\"");
  return it->get<double>();
}
}  // namespace

GpuProfile gpu_from_json_text(const std::string& text, const std::string& fallback_name) {
  const std::string what = "GPU profile '" + fallback_name + "'";
  json j = parse(text, what);
  GpuProfile g;
  g.name = j.value("name", fallback_name);
  g.fp8_tflops = need(j, "fp8_tflops", what);
  g.bf16_tflops = need(j, "bf16_tflops", what);
  g.hbm_bytes = need(j, "hbm_gb", what) * 1e9;
  g.hbm_gbps = need(j, "hbm_gbps", what);
  g.nvlink_gbps = need(j, "nvlink_gbps", what);
  g.gpus_per_node = j.value("gpus_per_node", 8);
  g.usable_fraction = j.value("usable_fraction", g.usable_fraction);
  g.runtime_reserve_bytes = j.value("runtime_reserve_gb", g.runtime_reserve_bytes / 1e9) * 1e9;
  if (j.contains("efficiency")) {
    const auto& e = j["efficiency"];
    g.eff.gemm_compute = e.value("gemm_compute", g.eff.gemm_compute);
    g.eff.gemm_memory = e.value("gemm_memory", g.eff.gemm_memory);
    g.eff.attention_memory = e.value("attention_memory", g.eff.attention_memory);
    g.eff.elementwise_memory = e.value("elementwise_memory", g.eff.elementwise_memory);
    g.eff.kernel_overhead_us = e.value("kernel_overhead_us", g.eff.kernel_overhead_us);
    g.eff.step_overhead_us = e.value("step_overhead_us", g.eff.step_overhead_us);
  }
  if (g.fp8_tflops <= 0 || g.hbm_gbps <= 0 || g.hbm_bytes <= 0)
    throw PlanError(what + ": fp8_tflops, hbm_gb and hbm_gbps must be > 0");
  return g;
}

NetworkProfile network_from_json_text(const std::string& text, const std::string& fallback_name) {
  const std::string what = "network profile '" + fallback_name + "'";
  json j = parse(text, what);
  NetworkProfile n;
  n.name = j.value("name", fallback_name);
  n.inter_node = j.value("inter_node", false);
  if (n.inter_node) {
    n.gbps_per_gpu = need(j, "gbps_per_gpu", what);
    n.efficiency = need(j, "efficiency", what);
    n.latency_us = need(j, "latency_us", what);
    if (n.gbps_per_gpu <= 0 || n.efficiency <= 0)
      throw PlanError(what + ": gbps_per_gpu and efficiency must be > 0");
  }
  n.kernel_us = j.value("kernel_us", 0.0);
  n.nvlink_efficiency = j.value("nvlink_efficiency", n.nvlink_efficiency);
  n.nvlink_latency_us = j.value("nvlink_latency_us", n.nvlink_latency_us);
  n.nvlink_transfer_in_kernel = j.value("nvlink_transfer_in_kernel", false);
  if (n.nvlink_efficiency <= 0) throw PlanError(what + ": nvlink_efficiency must be > 0");
  return n;
}

}  // namespace moelink::plan
