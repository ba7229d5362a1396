// moelink-plan: which EP/DP/TP layout, batch and overlap mode serves a MoE model
// at a target output speed for the lowest cost? See docs/planner.md.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "moelink/plan/calibration.h"
#include "moelink/plan/profiles.h"
#include "moelink/plan/report.h"
#include "moelink/plan/svg.h"
#include "moelink/version.h"

using namespace moelink::plan;

namespace {
void write_out(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text;
    return;
  }
  std::ofstream f(path, std::ios::binary);
  if (!f) throw PlanError("cannot write '" + path + "'");
  f << text;
}
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moelink-plan: deployment planner for MoE decode (roofline, overlap, Pareto frontiers)"};
  app.set_version_flag("--version", std::string("moelink-plan ") + moelink::version());
  std::string profiles_dir = default_profiles_dir(), model = "deepseek-v3", gpu = "h200", network;
  int ep = 8, dp = 0, tp = 1, gpn = 0, batch = 32, kv_len = 5000, mtp = 1;
  double acceptance = 0.6;
  std::string overlap = "dispatch", json_out, csv_out, svg_dir, calibrate;
  bool do_sweep = false, list = false, ignore_memory = false;
  std::vector<int> sweep_ep, sweep_tp{1, 2, 4, 8}, sweep_batch{1, 2, 4, 8, 16, 32, 64, 128};
  double target = 0;
  app.add_option("--profiles-dir", profiles_dir, "profile tree: models/, gpus/, networks/")->capture_default_str();
  app.add_option("-m,--model", model, "built-in model name or path to a Hugging Face config.json")->capture_default_str();
  app.add_option("-g,--gpu", gpu, "GPU profile")->capture_default_str();
  app.add_option("-n,--network", network, "network profile (default: nvlink for one node, ib-cx7 beyond)");
  app.add_option("--ep", ep, "expert-parallel GPUs")->capture_default_str();
  app.add_option("--dp", dp, "data-parallel groups (default EP / TP)");
  app.add_option("--tp", tp, "tensor-parallel GPUs per DP group")->capture_default_str();
  app.add_option("--gpus-per-node", gpn, "GPUs per node (default: from the GPU profile)");
  app.add_option("-b,--batch", batch, "requests per DP group (per GPU at TP1)")->capture_default_str();
  app.add_option("--kv-len", kv_len, "KV cache tokens per request")->capture_default_str();
  app.add_option("--mtp", mtp, "MTP draft tokens per step (query length = 1 + mtp)")->capture_default_str();
  app.add_option("--acceptance", acceptance, "draft acceptance rate")->capture_default_str();
  app.add_option("--overlap", overlap, "none | dispatch | microbatch")->capture_default_str();
  app.add_option("--calibrate", calibrate, "moelink-bench --json results: measured dispatch/combine latencies");
  app.add_flag("--sweep", do_sweep, "sweep layouts and batch sizes; print Pareto frontiers");
  app.add_option("--sweep-ep", sweep_ep, "EP sizes to sweep (default: the --ep value)")->delimiter(',');
  app.add_option("--sweep-tp", sweep_tp, "TP sizes to sweep")->delimiter(',')->capture_default_str();
  app.add_option("--sweep-batch", sweep_batch, "batch sizes to sweep")->delimiter(',')->capture_default_str();
  app.add_option("--target", target, "with --sweep: best layout at >= this output speed (tok/s)");
  app.add_option("--json", json_out, "write JSON to this file ('-' = stdout)");
  app.add_option("--csv", csv_out, "write CSV to this file ('-' = stdout)");
  app.add_option("--svg-dir", svg_dir, "write SVG charts into this directory");
  app.add_flag("--ignore-memory", ignore_memory, "plan a layout even when it does not fit in memory");
  app.add_flag("--list", list, "list the built-in models, GPUs and networks");
  CLI11_PARSE(app, argc, argv);

  try {
    ProfileStore store(profiles_dir);
    if (list) {
      std::printf("models:   %s\ngpus:     %s\nnetworks: %s\n(profiles in %s)\n", join(store.models()).c_str(),
                  join(store.gpus()).c_str(), join(store.networks()).c_str(), store.dir().c_str());
      return 0;
    }
    PlanInput in;
    in.model = store.model(model);
    in.gpu = store.gpu(gpu);
    in.layout = {ep, dp > 0 ? dp : (tp > 0 ? ep / tp : 0), tp, gpn > 0 ? gpn : in.gpu.gpus_per_node};
    const int max_ep = do_sweep && !sweep_ep.empty() ? *std::max_element(sweep_ep.begin(), sweep_ep.end()) : ep;
    in.net = store.network(!network.empty() ? network : (max_ep > in.layout.gpus_per_node ? "ib-cx7" : "nvlink"));
    in.work = {batch, kv_len, mtp, acceptance, overlap_from_string(overlap)};
    if (batch < 1 || kv_len < 0 || mtp < 0 || acceptance < 0 || acceptance > 1)
      throw PlanError("need batch >= 1, kv-len >= 0, mtp >= 0 and 0 <= acceptance <= 1");
    Calibration cal;
    if (!calibrate.empty()) {
      cal = Calibration::from_file(calibrate);
      in.calibration = &cal;
    }
    if (!svg_dir.empty()) std::filesystem::create_directories(svg_dir);

    if (do_sweep) {
      SweepSpec spec;
      spec.eps = sweep_ep.empty() ? std::vector<int>{ep} : sweep_ep;
      spec.tps = sweep_tp;
      spec.batches = sweep_batch;
      if (overlap != "dispatch") spec.overlaps = {in.work.overlap};
      auto pts = sweep(in, spec);
      if (pts.empty()) throw PlanError("no swept layout fits in memory and is valid for " + in.model.name);
      if (json_out.empty() && csv_out.empty()) {
        std::printf("%s on %s, %s, KV %d, query length %d: Pareto frontiers (throughput per node vs output speed)\n",
                    in.model.name.c_str(), in.gpu.name.c_str(), in.net.name.c_str(), kv_len, in.work.query_len());
        for (const auto& [e, f] : frontiers_by_ep(pts)) {
          std::printf("\nEP%d\n", e);
          std::fputs(format_sweep_table(f).c_str(), stdout);
        }
        if (target > 0) {
          const SweepPoint* best = nullptr;
          for (const auto& p : pts)
            if (p.output_tok_s >= target && (!best || p.throughput_node > best->throughput_node)) best = &p;
          if (best)
            std::printf("\nbest at >= %.0f tok/s: %s batch %d overlap %s: %.1f tok/s, %.0f tok/s per node\n", target,
                        best->layout.str().c_str(), best->work.batch, to_string(best->work.overlap),
                        best->output_tok_s, best->throughput_node);
          else
            std::printf("\nno swept layout reaches %.0f tok/s\n", target);
        }
      }
      if (!json_out.empty()) write_out(json_out, sweep_json(pts));
      if (!csv_out.empty()) write_out(csv_out, sweep_csv(pts));
      if (!svg_dir.empty())
        write_out(svg_dir + "/pareto.svg",
                  svg_pareto(pts, in.model.name + " on " + in.gpu.name + ": Pareto frontier per EP size"));
      return 0;
    }

    validate(in.layout, in.model, in.net);
    const MemoryReport mem = memory_report(in.model, in.gpu, in.layout, in.work);
    if (!ignore_memory) require_fits(mem, in.layout, in.work, in.gpu.name);
    const StepResult r = simulate_step(in);
    if (json_out.empty() && csv_out.empty()) std::fputs(format_step_table(in, r, mem).c_str(), stdout);
    if (!json_out.empty()) write_out(json_out, step_json(in, r, mem));
    if (!csv_out.empty()) write_out(csv_out, step_csv(in, r));
    if (in.calibration && json_out.empty() && csv_out.empty())
      std::printf("\n%s", format_calibration(compare_calibration(in, cal), cal).c_str());
    if (!svg_dir.empty()) {
      std::vector<std::pair<std::string, LayerTiming>> bars;
      for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kDispatchOverlap, OverlapMode::kMicroBatch}) {
        PlanInput x = in;
        x.work.overlap = m;
        bars.push_back({in.layout.str() + " " + to_string(m), layer_timing(x, batch, x.work.query_len(), true)});
      }
      write_out(svg_dir + "/breakdown.svg", svg_breakdown(bars, in.model.name + " MoE layer on " + in.gpu.name +
                                                                    ", batch " + std::to_string(batch)));
      std::vector<Kernel> ks = r.moe_layer.kernels;
      write_out(svg_dir + "/roofline.svg",
                svg_roofline(in.gpu, {{in.layout.str() + " b" + std::to_string(batch), ks}},
                             "Roofline of " + in.gpu.name + " with the MoE layer kernels"));
    }
    return 0;
  } catch (const PlanError& e) {
    std::fprintf(stderr, "moelink-plan: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-plan: error: %s\n", e.what());
    return 2;
  }
}
