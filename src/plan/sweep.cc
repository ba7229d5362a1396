#include "moelink/plan/sweep.h"

#include <algorithm>
#include <cmath>

namespace moelink::plan {

std::vector<SweepPoint> sweep(const PlanInput& base, const SweepSpec& spec) {
  std::vector<SweepPoint> out;
  for (int ep : spec.eps) {
    for (int tp : spec.tps) {
      if (tp > ep || ep % tp != 0) continue;
      Layout l{ep, ep / tp, tp, base.layout.gpus_per_node};
      try {
        validate(l, base.model, base.net);
      } catch (const PlanError&) {
        continue;
      }
      for (int b : spec.batches)
      for (OverlapMode ov : spec.overlaps) {
        PlanInput in = base;
        in.layout = l;
        in.work.batch = b;
        in.work.overlap = ov;
        const MemoryReport mem = memory_report(in.model, in.gpu, l, in.work);
        if (!mem.fits() && spec.skip_unfit) continue;
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
