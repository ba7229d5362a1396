#include "moelink/plan/report.h"

#include <cstdarg>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace moelink::plan {
namespace {
using nlohmann::json;

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

json kernel_json(const Kernel& k) {
  return {{"name", k.name}, {"class", to_string(k.cls)}, {"stage", k.stage}, {"flops", k.flops},
          {"bytes", k.bytes}, {"intensity", k.intensity()}, {"time_us", k.time_us},
          {"memory_bound", k.memory_bound}, {"m", k.m}, {"measured", k.measured}};
}

json layer_json(const LayerTiming& t) {
  json j;
  j["total_us"] = t.total_us;
  j["exposed_comm_us"] = t.exposed_comm_us;
  json cls = json::object();
  for (int c = 0; c < kNumKernelClasses; ++c) cls[to_string(KernelClass(c))] = t.class_us[c];
  j["class_us"] = cls;
  j["kernels"] = json::array();
  for (const auto& k : t.kernels) j["kernels"].push_back(kernel_json(k));
  auto comm = [](const CommCost& c) {
    return json{{"send_us", c.send_us}, {"transfer_us", c.transfer_us}, {"recv_us", c.recv_us},
                {"total_us", c.total_us()}, {"bytes_nvlink", c.bytes_nvlink},
                {"bytes_network", c.bytes_network}, {"measured", c.measured}};
  };
  j["dispatch"] = comm(t.dispatch);
  j["combine"] = comm(t.combine);
  return j;
}

json point_json(const SweepPoint& p) {
  return {{"ep", p.layout.ep}, {"dp", p.layout.dp}, {"tp", p.layout.tp}, {"batch", p.work.batch},
          {"overlap", to_string(p.work.overlap)}, {"gpu", p.gpu}, {"output_tok_s", p.output_tok_s},
          {"throughput_node", p.throughput_node}, {"throughput_gpu", p.throughput_gpu},
          {"step_us", p.step_us}, {"tokens_per_expert", p.tokens_per_expert},
          {"groupgemm_memory_bound", p.groupgemm_memory_bound}, {"fits", p.fits}};
}
}  // namespace

std::string format_step_table(const PlanInput& in, const StepResult& r, const MemoryReport& mem) {
  std::string s;
  s += fmt("%s on %s x %d (%d node%s, %s), %s, overlap %s\n", in.model.name.c_str(), in.gpu.name.c_str(),
           in.layout.gpus(), in.layout.nodes(), in.layout.nodes() > 1 ? "s" : "", in.net.name.c_str(),
           in.layout.str().c_str(), to_string(in.work.overlap));
  s += fmt("batch %d per DP group, KV %d tokens, query length %d (MTP %d draft, acceptance %.2f)\n\n",
           in.work.batch, in.work.kv_len, in.work.query_len(), in.work.draft_tokens, in.work.acceptance);
  const bool mb = in.work.overlap == OverlapMode::kMicroBatch;
  s += fmt("MoE layer kernels (per GPU%s):\n", mb ? ", one micro-batch of two" : "");
  s += fmt("  %-18s %-16s %5s %12s %12s %9s %9s %s\n", "kernel", "class", "stage", "GFLOP", "MB", "FLOP/B",
           "time us", "bound");
  for (const auto& k : r.moe_layer.kernels)
    s += fmt("  %-18s %-16s %5d %12.3f %12.3f %9.1f %9.1f %s%s\n", k.name.c_str(), to_string(k.cls), k.stage,
             k.flops / 1e9, k.bytes / 1e6, k.intensity(), k.time_us, k.memory_bound ? "memory" : "compute",
             k.measured ? " [measured]" : "");
  auto comm = [&](const char* n, const CommCost& c) {
    s += fmt("  %-18s send %.1f + transfer %.1f + recv %.1f = %.1f us (NVLink %.2f MB, network %.2f MB)%s\n", n,
             c.send_us, c.transfer_us, c.recv_us, c.total_us(), c.bytes_nvlink / 1e6, c.bytes_network / 1e6,
             c.measured ? " [measured]" : "");
  };
  comm("dispatch", r.moe_layer.dispatch);
  comm("combine", r.moe_layer.combine);
  s += "\nMoE layer time by class (us, dispatch/combine as exposed):\n";
  for (int c = 0; c < kNumKernelClasses; ++c)
    if (r.moe_layer.class_us[c] > 0)
      s += fmt("  %-18s %9.1f  %5.1f%%\n", to_string(KernelClass(c)), r.moe_layer.class_us[c],
               100 * r.moe_layer.class_us[c] / r.moe_layer.total_us);
  s += fmt("  %-18s %9.1f\n", "total", r.moe_layer.total_us);
  s += fmt("\nGroupGEMM: %.1f tokens per expert, %.1f of %.0f local experts active\n", r.shape.tokens_per_expert,
           r.shape.active_experts, r.shape.local_experts);
  s += fmt("Step: %lld MoE x %.1f + %lld dense x %.1f + head %.1f + MTP draft %.1f = %.1f us\n",
           (long long)in.model.num_moe_layers(), r.moe_layer.total_us, (long long)in.model.num_dense_layers,
           r.dense_layer.total_us, r.head_us, r.draft_us, r.step_us);
  s += fmt("Output speed %.1f tok/s per request (%.2f tokens per step); throughput %.0f tok/s per GPU, %.0f per node\n",
           r.output_tok_s, r.tokens_per_step, r.throughput_gpu, r.throughput_node);
  s += fmt("\nMemory per GPU (GB): weights %.1f (routed experts %.1f, attention %.1f, shared %.1f, dense MLP %.1f, "
           "embeddings %.1f, MTP %.1f, other %.1f)\n",
           mem.weight_bytes / 1e9, mem.routed_expert_bytes / 1e9, mem.attention_bytes / 1e9,
           mem.shared_expert_bytes / 1e9, mem.dense_mlp_bytes / 1e9, mem.embedding_bytes / 1e9, mem.mtp_bytes / 1e9,
           mem.other_bytes / 1e9);
  s += fmt("  KV %.1f (%.0f bytes per token), buffers %.1f, reserve %.1f; used %.1f of %.1f: %s %.1f; "
           "max batch %d\n",
           mem.kv_bytes / 1e9, mem.kv_bytes_per_token, mem.buffer_bytes / 1e9, mem.reserve_bytes / 1e9,
           mem.used_bytes / 1e9, mem.capacity_bytes / 1e9, mem.fits() ? "free" : "OVER BY",
           std::abs(mem.free_bytes) / 1e9, mem.max_batch);
  return s;
}

std::string step_json(const PlanInput& in, const StepResult& r, const MemoryReport& mem) {
  json j;
  j["model"] = in.model.name;
  j["gpu"] = in.gpu.name;
  j["network"] = in.net.name;
  j["layout"] = {{"ep", in.layout.ep}, {"dp", in.layout.dp}, {"tp", in.layout.tp},
                 {"gpus_per_node", in.layout.gpus_per_node}, {"nodes", in.layout.nodes()}};
  j["workload"] = {{"batch", in.work.batch}, {"kv_len", in.work.kv_len}, {"draft_tokens", in.work.draft_tokens},
                   {"acceptance", in.work.acceptance}, {"overlap", to_string(in.work.overlap)}};
  j["moe_layer"] = layer_json(r.moe_layer);
  if (in.model.num_dense_layers > 0) j["dense_layer"] = layer_json(r.dense_layer);
  j["tokens_per_expert"] = r.tokens_per_expert;
  j["active_experts"] = r.shape.active_experts;
  j["head_us"] = r.head_us;
  j["draft_us"] = r.draft_us;
  j["step_us"] = r.step_us;
  j["tokens_per_step"] = r.tokens_per_step;
  j["output_tok_s"] = r.output_tok_s;
  j["throughput_gpu"] = r.throughput_gpu;
  j["throughput_node"] = r.throughput_node;
  j["memory"] = {{"weight_bytes", mem.weight_bytes}, {"routed_expert_bytes", mem.routed_expert_bytes},
                 {"attention_bytes", mem.attention_bytes}, {"kv_bytes_per_token", mem.kv_bytes_per_token},
                 {"kv_bytes", mem.kv_bytes}, {"buffer_bytes", mem.buffer_bytes},
                 {"reserve_bytes", mem.reserve_bytes}, {"capacity_bytes", mem.capacity_bytes},
                 {"free_bytes", mem.free_bytes}, {"fits", mem.fits()}, {"max_batch", mem.max_batch}};
  return j.dump(1) + "\n";
}

std::string step_csv(const PlanInput& in, const StepResult& r) {
  std::string s = "layer,kernel,class,stage,flops,bytes,intensity,time_us,memory_bound\n";
  auto rows = [&](const char* layer, const LayerTiming& t) {
    for (const auto& k : t.kernels)
      s += fmt("%s,%s,%s,%d,%.6g,%.6g,%.6g,%.6g,%d\n", layer, k.name.c_str(), to_string(k.cls), k.stage, k.flops,
               k.bytes, k.intensity(), k.time_us, k.memory_bound ? 1 : 0);
    s += fmt("%s,dispatch,Dispatch,3,0,%.6g,0,%.6g,0\n", layer, t.dispatch.bytes_nvlink + t.dispatch.bytes_network,
             t.dispatch.total_us());
    s += fmt("%s,combine,Combine,4,0,%.6g,0,%.6g,0\n", layer, t.combine.bytes_nvlink + t.combine.bytes_network,
             t.combine.total_us());
  };
  rows("moe", r.moe_layer);
  if (in.model.num_dense_layers > 0) {
    for (const auto& k : r.dense_layer.kernels)
      s += fmt("dense,%s,%s,%d,%.6g,%.6g,%.6g,%.6g,%d\n", k.name.c_str(), to_string(k.cls), k.stage, k.flops,
               k.bytes, k.intensity(), k.time_us, k.memory_bound ? 1 : 0);
  }
  return s;
}

std::string format_sweep_table(const std::vector<SweepPoint>& pts) {
  std::string s = fmt("%-20s %6s %-10s %10s %12s %11s %9s %10s\n", "layout", "batch", "overlap", "tok/s/req",
                      "tok/s/node", "tok/s/GPU", "step ms", "m/expert");
  for (const auto& p : pts)
    s += fmt("%-20s %6d %-10s %10.1f %12.0f %11.0f %9.2f %10.1f\n", p.layout.str().c_str(), p.work.batch,
             to_string(p.work.overlap), p.output_tok_s, p.throughput_node, p.throughput_gpu, p.step_us / 1e3,
             p.tokens_per_expert);
  return s;
}

std::string sweep_json(const std::vector<SweepPoint>& pts, const std::vector<SkippedLayout>& skipped) {
  json j = json::object();
  j["points"] = json::array();
  for (const auto& p : pts) j["points"].push_back(point_json(p));
  const bool several = count_gpus(pts) > 1;
  json fr = json::object();
  for (const auto& [key, f] : frontiers_by_gpu_and_ep(pts)) {
    json a = json::array();
    for (const auto& p : f) a.push_back(point_json(p));
    fr[frontier_name(key, several)] = a;
  }
  j["frontiers"] = fr;
  j["skipped"] = json::array();
  for (const auto& s : skipped) {
    j["skipped"].push_back({{"gpu", s.gpu}, {"ep", s.ep}, {"tp", s.tp}, {"dp", s.dp}, {"batches", s.batches},
                            {"whole_layout", s.whole_layout}, {"reason", s.reason}, {"text", s.str()}});
  }
  return j.dump(1) + "\n";
}

std::string sweep_csv(const std::vector<SweepPoint>& pts) {
  std::string s = "ep,dp,tp,batch,overlap,gpu,output_tok_s,throughput_node,throughput_gpu,step_us,tokens_per_expert,"
                  "groupgemm_memory_bound,pareto\n";
  auto fr = frontiers_by_gpu_and_ep(pts);
  for (const auto& p : pts) {
    bool on = false;
    for (const auto& q : fr[{p.gpu, p.layout.ep}])
      on |= q.layout.tp == p.layout.tp && q.work.batch == p.work.batch && q.work.overlap == p.work.overlap;
    s += fmt("%d,%d,%d,%d,%s,%s,%.6g,%.6g,%.6g,%.6g,%.6g,%d,%d\n", p.layout.ep, p.layout.dp, p.layout.tp,
             p.work.batch, to_string(p.work.overlap), p.gpu.c_str(), p.output_tok_s, p.throughput_node,
             p.throughput_gpu, p.step_us, p.tokens_per_expert, p.groupgemm_memory_bound ? 1 : 0, on ? 1 : 0);
  }
  return s;
}

std::string format_skipped(const std::vector<SkippedLayout>& skipped) {
  if (skipped.empty()) return "";
  std::string s = fmt("Left out of the sweep (%zu):\n", skipped.size());
  for (const auto& k : skipped) s += "  " + k.str() + "\n";
  return s;
}

namespace {
// The attention bench's cases at the plan's heads per GPU, query length and
// context: the modelled attention step beside the measured one, a row a
// measured batch (requests).
std::vector<CalibrationRow> compare_attention(const PlanInput& base, const Calibration& c) {
  std::vector<CalibrationRow> rows;
  const int heads = int(base.model.num_heads / base.layout.tp), q = base.work.query_len();
  const int kv = base.work.kv_len;
  for (const auto& smp : c.samples) {
    if (!smp.is_case(heads, q, kv)) continue;
    double model = 0;
    for (const auto& k : layer_compute_kernels(base.model, base.gpu, base.layout, smp.tokens, q, kv, true))
      if (Calibration::attention_step_kernel(k.name)) model += k.time_us;
    rows.push_back({smp.tokens, smp.mode, Calibration::kAttentionStep, model, smp.us.at(Calibration::kAttentionStep)});
  }
  return rows;
}
}  // namespace

std::vector<CalibrationRow> compare_calibration(const PlanInput& base, const Calibration& c) {
  if (c.format == Calibration::Format::kAttentionBench) return compare_attention(base, c);
  std::vector<CalibrationRow> rows;
  // A stand-in for one EP rank is compared with that rank, on what it measures.
  const int stand_in = c.stand_in_ep(long(base.model.hidden), int(base.model.num_experts));
  const int ep = stand_in > 0 ? stand_in : c.world_size;
  const Layout l{ep, ep, 1, base.layout.gpus_per_node};
  const int q = base.work.query_len();
  for (const auto& smp : c.samples) {
    // The bench runs `tokens` tokens per rank: batch x query length = tokens at TP1.
    const double batch = smp.tokens / q;
    const LayerShape s = layer_shape(base.model, l, batch, q);
    // Modelled time per measured name, in the layer's kernel order; dispatch and combine last.
    std::vector<std::pair<std::string, double>> model;
    for (const auto& k : layer_compute_kernels(base.model, base.gpu, l, batch, q, base.work.kv_len, true)) {
      const std::string name = Calibration::measured_name(k.name);
      if (model.empty() || model.back().first != name) model.push_back({name, 0});
      model.back().second += k.time_us;
    }
    model.push_back({"dispatch", dispatch_cost(base.model, base.gpu, base.net, l, s).total_us()});
    model.push_back({"combine", combine_cost(base.model, base.gpu, base.net, l, s).total_us()});
    CalibrationRow sum{smp.tokens, smp.mode, "sum", 0, 0};
    for (const auto& [name, us] : model) {
      if (!c.measures(name) || (stand_in > 0 && !Calibration::rank_measured(name))) continue;
      rows.push_back({smp.tokens, smp.mode, name, us, smp.us.at(name)});
      sum.model_us += us;
      sum.measured_us += smp.us.at(name);
    }
    rows.push_back(sum);
  }
  return rows;
}

std::string format_calibration(const std::vector<CalibrationRow>& rows, const Calibration& c, int ep) {
  if (c.format == Calibration::Format::kAttentionBench) {
    std::string s = fmt("Calibration from %s (attention_bench.py, %s, %s; hidden %ld, kv_lora_rank %d):\n"
                        "model vs measured attention step at the plan's heads per GPU, q_len and kv, us\n",
                        c.source.c_str(), c.machine.c_str(), c.date.c_str(), c.hidden_dim, c.kv_lora_rank);
    s += fmt("  %8s %-12s %-14s %9s %9s %10s\n", "requests", "decode", "kernel", "model", "measured", "meas/model");
    for (const auto& r : rows)
      s += fmt("  %8.0f %-12s %-14s %9.1f %9.1f %10.2f\n", r.tokens, r.mode.c_str(), r.kernel.c_str(), r.model_us,
               r.measured_us, r.measured_us / r.model_us);
    s += "  attention_step = input_norm + qkv_a_proj + q_kv_a_norm + q_b_proj + k_b_absorb + rope_append_kv +\n"
         "  attention + v_b_proj + o_proj (the bench's whole forward, busy GPU time; split in the modelled\n"
         "  proportions); it calibrates the dense and the MoE layers alike\n";
    return s;
  }
  if (ep <= 0) ep = c.world_size;
  const bool layer = c.format == Calibration::Format::kLayerBench;
  std::string s = fmt("Calibration from %s (%s, %s, %s; %d rank%s, hidden %ld", c.source.c_str(),
                      layer ? "layer_bench.py" : "moelink-bench", c.machine.c_str(), c.date.c_str(), c.world_size,
                      c.world_size == 1 ? "" : "s", c.hidden_dim);
  if (layer) s += fmt(", %d routed experts", c.experts);
  s += fmt("):\nmodel vs measured%s at EP%d DP%d TP1%s, us\n", layer ? " MoE-layer stages" : " p50", ep, ep,
           ep != c.world_size ? " (one rank: the file stands in for it)" : "");
  s += fmt("  %11s %-16s %-14s %9s %9s %10s\n", "tokens/rank", layer ? "mode" : "", "kernel", "model",
           "measured", "meas/model");
  double last = -1;
  for (const auto& r : rows) {
    const bool first = r.tokens != last;
    last = r.tokens;
    s += fmt("  %11s %-16s %-14s %9.1f %9.1f %10.2f\n", first ? fmt("%.0f", r.tokens).c_str() : "",
             first ? r.mode.c_str() : "", r.kernel.c_str(), r.model_us, r.measured_us, r.measured_us / r.model_us);
  }
  if (layer)
    s += "  shared_expert = shared_gate_up + shared_act + shared_down (one measured stage, split in the\n"
         "  modelled proportions); dispatch = quantize + send + receive stages (the model has no kernel\n"
         "  that quantizes the layer's input); combine = send + receive stages\n";
  return s;
}

}  // namespace moelink::plan
