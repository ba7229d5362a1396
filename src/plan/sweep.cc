#include "moelink/plan/sweep.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

namespace moelink::plan {
namespace {
// Sizes below 1 are not layouts a sweep may quietly leave out: they are input
// errors (batch -1 gave negative throughput), so they stop the sweep.
void check_sizes(const std::vector<int>& v, const char* what) {
  if (v.empty()) throw PlanError(std::string("sweep: no ") + what + " given");
  for (int x : v)
    if (x < 1) throw PlanError(std::string("sweep: ") + what + " " + std::to_string(x) + " is out of range (must be >= 1)");
}

void check_spec(const SweepSpec& spec) {
  check_sizes(spec.eps, "EP size");
  check_sizes(spec.tps, "TP size");
  check_sizes(spec.batches, "batch size");
  if (spec.overlaps.empty()) throw PlanError("sweep: no overlap mode given");
}

std::string list_ints(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

// Why batch sizes of a valid layout were left out: when the weights alone
// overflow, that; else the smallest batch left out, what it needs and how many
// requests do fit, so the user sees how far off the layout is.
std::string memory_reason(const MemoryReport& r, int smallest, const std::vector<int>& left_out, bool whole) {
  char buf[384];
  if (r.max_batch == 0) {
    std::snprintf(buf, sizeof buf,
                  "does not fit in memory: weights + reserve alone need %.1f GB > %.1f GB per GPU (weights %.1f, "
                  "reserve %.1f GB), so no batch fits",
                  (r.weight_bytes + r.reserve_bytes) / 1e9, r.capacity_bytes / 1e9, r.weight_bytes / 1e9,
                  r.reserve_bytes / 1e9);
    return buf;
  }
  std::snprintf(buf, sizeof buf,
                "batch %d needs %.1f GB > %.1f GB per GPU (weights %.1f, KV %.1f, buffers %.1f, reserve %.1f GB); "
                "at most %d requests per DP group fit",
                smallest, r.used_bytes / 1e9, r.capacity_bytes / 1e9, r.weight_bytes / 1e9, r.kv_bytes / 1e9,
                r.buffer_bytes / 1e9, r.reserve_bytes / 1e9, r.max_batch);
  if (whole) return std::string("no swept batch fits in memory: ") + buf;
  return std::string(left_out.size() > 1 ? "batches " : "batch ") + list_ints(left_out) + " left out (memory): " + buf;
}
}  // namespace

std::string SkippedLayout::str() const {
  std::string s = "EP" + std::to_string(ep);
  if (tp == 0) s += " (every TP)";
  else s += (dp > 0 ? " DP" + std::to_string(dp) : "") + " TP" + std::to_string(tp);
  if (!gpu.empty()) s += " on " + gpu;
  return s + ": " + reason;
}

std::vector<SweepPoint> sweep(const PlanInput& base, const SweepSpec& spec, std::vector<SkippedLayout>* skipped) {
  check_spec(spec);
  auto skip = [&](SkippedLayout s) {
    if (skipped) skipped->push_back(std::move(s));
  };
  const int gpn = base.layout.gpus_per_node;
  std::vector<SweepPoint> out;
  for (int ep : spec.eps) {
    // An EP size the model or network rules out is one entry, not one per TP size.
    const std::string ep_why = ep_problem(ep, gpn, base.model, base.net);
    if (!ep_why.empty()) {
      skip({base.gpu.name, ep, 0, 0, spec.batches, true, ep_why});
      continue;
    }
    for (int tp : spec.tps) {
      Layout l{ep, ep % tp == 0 ? ep / tp : 0, tp, gpn};
      const std::string why = layout_problem(l, base.model, base.net);
      if (!why.empty()) {
        skip({base.gpu.name, ep, tp, l.dp, spec.batches, true, why});
        continue;
      }
      std::vector<int> unfit;
      MemoryReport smallest_unfit;
      int smallest = 0;
      for (int b : spec.batches) {
        PlanInput in = base;
        in.layout = l;
        in.work.batch = b;
        // Memory does not depend on the overlap mode: one check per batch.
        const MemoryReport mem = memory_report(in.model, in.gpu, l, in.work);
        if (!mem.fits() && spec.skip_unfit) {
          unfit.push_back(b);
          if (smallest == 0 || b < smallest) smallest = b, smallest_unfit = mem;
          continue;
        }
        for (OverlapMode ov : spec.overlaps) {
          in.work.overlap = ov;
          const StepResult r = simulate_step(in);
          SweepPoint p;
          p.layout = l;
          p.work = in.work;
          p.gpu = in.gpu.name;
          p.output_tok_s = r.output_tok_s;
          p.throughput_node = r.throughput_node;
          p.throughput_gpu = r.throughput_gpu;
          p.step_us = r.step_us;
          p.tokens_per_expert = r.tokens_per_expert;
          p.fits = mem.fits();
          for (const auto& k : r.moe_layer.kernels)
            if (k.cls == KernelClass::kGroupGemm && !k.memory_bound) p.groupgemm_memory_bound = false;
          out.push_back(p);
        }
      }
      if (!unfit.empty()) {
        const bool whole = unfit.size() == spec.batches.size();
        skip({base.gpu.name, ep, tp, l.dp, unfit, whole, memory_reason(smallest_unfit, smallest, unfit, whole)});
      }
    }
  }
  return out;
}

std::vector<SweepPoint> pareto_frontier(std::vector<SweepPoint> pts) {
  std::sort(pts.begin(), pts.end(), [](const SweepPoint& a, const SweepPoint& b) {
    if (a.output_tok_s != b.output_tok_s) return a.output_tok_s > b.output_tok_s;
    return a.throughput_node > b.throughput_node;
  });
  std::vector<SweepPoint> f;
  double best = -1;
  for (const auto& p : pts) {
    if (p.throughput_node > best) {
      f.push_back(p);
      best = p.throughput_node;
    }
  }
  std::reverse(f.begin(), f.end());  // ascending speed
  return f;
}

std::map<int, std::vector<SweepPoint>> frontiers_by_ep(const std::vector<SweepPoint>& pts) {
  std::map<int, std::vector<SweepPoint>> groups;
  for (const auto& p : pts) groups[p.layout.ep].push_back(p);
  for (auto& [ep, v] : groups) v = pareto_frontier(std::move(v));
  return groups;
}

std::map<FrontierKey, std::vector<SweepPoint>> frontiers_by_gpu_and_ep(const std::vector<SweepPoint>& pts) {
  std::map<FrontierKey, std::vector<SweepPoint>> groups;
  for (const auto& p : pts) groups[{p.gpu, p.layout.ep}].push_back(p);
  for (auto& [key, v] : groups) v = pareto_frontier(std::move(v));
  return groups;
}

std::string frontier_name(const FrontierKey& k, bool with_gpu) {
  return "EP" + std::to_string(k.second) + (with_gpu && !k.first.empty() ? " on " + k.first : "");
}

int count_gpus(const std::vector<SweepPoint>& pts) {
  std::set<std::string> names;
  for (const auto& p : pts) names.insert(p.gpu);
  return int(names.size());
}

double throughput_at_speed(const std::vector<SweepPoint>& pts, double speed) {
  double best = 0;
  for (const auto& p : pts)
    if (p.output_tok_s >= speed) best = std::max(best, p.throughput_node);
  return best;
}

double frontier_throughput_at(const std::vector<SweepPoint>& f, double speed) {
  if (f.empty() || speed > f.back().output_tok_s) return 0;
  if (speed <= f.front().output_tok_s) return f.front().throughput_node;
  for (size_t i = 1; i < f.size(); ++i) {
    if (speed <= f[i].output_tok_s) {
      const auto& a = f[i - 1];
      const auto& b = f[i];
      const double t = (speed - a.output_tok_s) / (b.output_tok_s - a.output_tok_s);
      return std::exp(std::log(a.throughput_node) + t * (std::log(b.throughput_node) - std::log(a.throughput_node)));
    }
  }
  return f.back().throughput_node;
}

}  // namespace moelink::plan
