// moelink-plan: which EP/DP/TP layout, batch and overlap mode serves a MoE model
// at a target output speed for the lowest cost? See docs/planner.md.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "moelink/plan/calibration.h"
#include "moelink/plan/options.h"
#include "moelink/plan/profiles.h"
#include "moelink/plan/report.h"
#include "moelink/plan/svg.h"
#include "moelink/version.h"

using namespace moelink::plan;

namespace {
// Allowed values of the numeric options (docs/planner.md, "Options"). The upper
// bounds are far beyond any deployment; they catch typos and int overflow.
const IntRange kEpRange{1, 4096, "GPUs"};
const IntRange kDpRange{1, 4096, "DP groups"};
const IntRange kTpRange{1, 1024, "GPUs per DP group"};
const IntRange kGpusPerNodeRange{1, 1024, "GPUs per node"};
const IntRange kBatchRange{1, 65536, "requests per DP group"};
const IntRange kKvLenRange{0, 10000000, "tokens per request"};
const IntRange kMtpRange{0, 16, "draft tokens per step"};
const RealRange kAcceptanceRange{0, 1, "fraction of draft tokens accepted"};
const RealRange kTargetRange{0, 100000, "tok/s per request; 0 = no target"};

// Everything the command line sets. 0 for dp / gpus_per_node: not given (derived).
struct Options {
  std::string profiles_dir = default_profiles_dir(), model = "deepseek-v3", gpu = "h200", network;
  int ep = 8, dp = 0, tp = 1, gpus_per_node = 0, batch = 32, kv_len = 5000, mtp = 1;
  double acceptance = 0.6, target = 0;
  std::string overlap = "dispatch", json_out, csv_out, svg_dir;
  std::vector<std::string> calibrate;
  bool sweep = false, list = false, ignore_memory = false;
  std::vector<int> sweep_ep, sweep_tp{1, 2, 4, 8}, sweep_batch{1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<std::string> sweep_gpu;
};

// CLI11 validators run on each value before conversion (each comma-separated
// value of a list), so "abc", "0" and "-1" all get the option's range and unit;
// CLI11 puts the option's name in front.
CLI::Validator ints(const IntRange& r) {
  return CLI::Validator([r](std::string& s) { return check_int(s, r); }, "");
}
CLI::Validator reals(const RealRange& r) {
  return CLI::Validator([r](std::string& s) { return check_real(s, r); }, "");
}
std::string allowed(const IntRange& r) { return "; allowed: " + r.str(); }
std::string allowed(const RealRange& r) { return "; allowed: " + r.str(); }

void add_options(CLI::App& app, Options& o) {
  CLI::Option* sweep = app.add_flag("--sweep", o.sweep,
                                    "sweep GPUs x layouts x batch sizes; print Pareto frontiers "
                                    "(throughput per node vs output speed, tok/s)");
  app.add_option("--profiles-dir", o.profiles_dir, "profile tree (directory with models/, gpus/, networks/)")
      ->capture_default_str();
  app.add_option("-m,--model", o.model, "model: built-in name or path to a Hugging Face config.json")
      ->capture_default_str();
  app.add_option("-g,--gpu", o.gpu,
                 "GPU profile (name or .json path): peak TFLOP/s, HBM GB and GB/s, NVLink GB/s; one type "
                 "(several: --sweep-gpu)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) {
            return s.find(',') == std::string::npos
                       ? std::string()
                       : "'" + s + "' names several GPUs; one plan takes one GPU type (compare several with "
                                   "--sweep --sweep-gpu " + s + ")";
          },
          ""));
  app.add_option("-n,--network", o.network,
                 "network profile (name or .json path): NIC GB/s per GPU, latency us (default: nvlink for one "
                 "node, ib-cx7 beyond)");
  app.add_option("--ep", o.ep, "expert-parallel size (EP)" + allowed(kEpRange))
      ->capture_default_str()
      ->check(ints(kEpRange));
  app.add_option("--dp", o.dp, "data-parallel (attention) groups, default EP / TP" + allowed(kDpRange))
      ->check(ints(kDpRange));
  app.add_option("--tp", o.tp, "tensor-parallel size (TP, must divide EP)" + allowed(kTpRange))
      ->capture_default_str()
      ->check(ints(kTpRange));
  app.add_option("--gpus-per-node", o.gpus_per_node,
                 "node size, default from the GPU profile (8)" + allowed(kGpusPerNodeRange))
      ->check(ints(kGpusPerNodeRange));
  app.add_option("-b,--batch", o.batch, "batch size (per GPU at TP1)" + allowed(kBatchRange))
      ->capture_default_str()
      ->check(ints(kBatchRange));
  app.add_option("--kv-len", o.kv_len, "KV cache length" + allowed(kKvLenRange))
      ->capture_default_str()
      ->check(ints(kKvLenRange));
  app.add_option("--mtp", o.mtp, "MTP drafts (query length = 1 + mtp tokens)" + allowed(kMtpRange))
      ->capture_default_str()
      ->check(ints(kMtpRange));
  app.add_option("--acceptance", o.acceptance, "draft acceptance rate" + allowed(kAcceptanceRange))
      ->capture_default_str()
      ->check(reals(kAcceptanceRange));
  app.add_option("--overlap", o.overlap, "overlap mode of dispatch/combine: none | dispatch | microbatch")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) {
            try {
              overlap_from_string(s);
              return std::string();
            } catch (const PlanError& e) {
              return std::string(e.what());
            }
          },
          ""));
  // One value per occurrence, so a moelink-bench file and a layer-bench file can both be given.
  app.add_option("--calibrate", o.calibrate,
                 "measured times (file, repeatable; a later file wins): moelink-bench --json (dispatch/combine "
                 "p50 latencies, us), tools/bench/layer_bench.py --json (MoE-layer stage times, us) or "
                 "tools/bench/attention_bench.py --step-kernels --json (the attention step of every layer, us)")
      ->allow_extra_args(false);
  app.add_option("--sweep-gpu", o.sweep_gpu,
                 "GPU profiles to sweep, comma-separated (default: the --gpu value); one Pareto chart/CSV "
                 "with a frontier per GPU and EP")
      ->delimiter(',')
      ->needs(sweep);
  app.add_option("--sweep-ep", o.sweep_ep, "EP sizes to sweep, comma-separated (default: the --ep value)" + allowed(kEpRange))
      ->delimiter(',')
      ->check(ints(kEpRange))
      ->needs(sweep);
  app.add_option("--sweep-tp", o.sweep_tp, "TP sizes to sweep, comma-separated" + allowed(kTpRange))
      ->delimiter(',')
      ->capture_default_str()
      ->check(ints(kTpRange))
      ->needs(sweep);
  app.add_option("--sweep-batch", o.sweep_batch,
                 "batch sizes to sweep, comma-separated" + allowed(kBatchRange))
      ->delimiter(',')
      ->capture_default_str()
      ->check(ints(kBatchRange))
      ->needs(sweep);
  app.add_option("--target", o.target, "best swept layout at >= this output speed" +
                                           allowed(kTargetRange))
      ->check(reals(kTargetRange))
      ->needs(sweep);
  app.add_option("--json", o.json_out, "write JSON to this file ('-' = stdout); times in us, speeds in tok/s, "
                                       "memory in bytes");
  app.add_option("--csv", o.csv_out, "write CSV to this file ('-' = stdout); same units as --json");
  app.add_option("--svg-dir", o.svg_dir, "write SVG charts into this directory (breakdown, roofline; pareto "
                                         "with --sweep)");
  app.add_flag("--ignore-memory", o.ignore_memory, "plan a layout even when it does not fit in HBM (GB)");
  app.add_flag("--list", o.list, "list the built-in models, GPUs and networks");
}

void write_out(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text;
    return;
  }
  std::ofstream f(path, std::ios::binary);
  if (!f) throw PlanError("cannot write '" + path + "'");
  f << text;
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// A profile lookup whose error names the option the name came from.
template <class F>
auto for_option(const std::string& option, F&& lookup) {
  try {
    return lookup();
  } catch (const PlanError& e) {
    throw PlanError(option + ": " + e.what());
  }
}

// --ep/--dp/--tp are checked one by one by their ranges; here what only the
// combination can get wrong, naming the options and values involved.
void check_split(const Options& o) {
  if (o.ep % o.tp != 0) {
    std::string divisors;
    for (int t = 1; t <= o.ep; ++t)
      if (o.ep % t == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(t);
    throw PlanError("--tp " + std::to_string(o.tp) + " does not divide --ep " + std::to_string(o.ep) +
                    "; allowed: a divisor of EP (" + divisors + ") GPUs per DP group");
  }
  if (o.dp > 0 && o.dp * o.tp != o.ep)
    throw PlanError("--dp " + std::to_string(o.dp) + " x --tp " + std::to_string(o.tp) + " = " +
                    std::to_string(o.dp * o.tp) + " GPUs, but --ep is " + std::to_string(o.ep) +
                    "; allowed: --dp " + std::to_string(o.ep / o.tp) + " (EP / TP) DP groups");
}

int gpus_per_node(const Options& o, const GpuProfile& g) { return o.gpus_per_node > 0 ? o.gpus_per_node : g.gpus_per_node; }

// nvlink when every planned layout fits in one node of every GPU, else ib-cx7.
NetworkProfile pick_network(const Options& o, const ProfileStore& store, const std::vector<GpuProfile>& gpus) {
  if (!o.network.empty()) return for_option("--network", [&] { return store.network(o.network); });
  int max_ep = o.ep;
  if (o.sweep && !o.sweep_ep.empty()) max_ep = *std::max_element(o.sweep_ep.begin(), o.sweep_ep.end());
  bool inter_node = false;
  for (const auto& g : gpus) inter_node |= max_ep > gpus_per_node(o, g);
  return store.network(inter_node ? "ib-cx7" : "nvlink");
}

// The GPU profiles of the run: --sweep-gpu (with --sweep), else --gpu; a GPU named twice counts once.
std::vector<GpuProfile> load_gpus(const Options& o, const ProfileStore& store) {
  const bool several = o.sweep && !o.sweep_gpu.empty();
  std::vector<GpuProfile> gpus;
  for (const auto& name : several ? o.sweep_gpu : std::vector<std::string>{o.gpu}) {
    GpuProfile g = for_option(several ? "--sweep-gpu" : "--gpu", [&] { return store.gpu(name); });
    if (std::none_of(gpus.begin(), gpus.end(), [&](const GpuProfile& x) { return x.name == g.name; }))
      gpus.push_back(g);
  }
  return gpus;
}

void print_best(const std::vector<SweepPoint>& pts, double target, bool several_gpus) {
  const SweepPoint* best = nullptr;
  for (const auto& p : pts)
    if (p.output_tok_s >= target && (!best || p.throughput_node > best->throughput_node)) best = &p;
  if (!best) {
    std::printf("\nno swept layout reaches %.0f tok/s\n", target);
    return;
  }
  std::printf("\nbest at >= %.0f tok/s: %s%s batch %d overlap %s: %.1f tok/s, %.0f tok/s per node\n", target,
              best->layout.str().c_str(), several_gpus ? (" on " + best->gpu).c_str() : "", best->work.batch,
              to_string(best->work.overlap), best->output_tok_s, best->throughput_node);
}

int run_sweep(const Options& o, const PlanInput& in, const std::vector<GpuProfile>& gpus) {
  SweepSpec spec;
  spec.eps = o.sweep_ep.empty() ? std::vector<int>{o.ep} : o.sweep_ep;
  spec.tps = o.sweep_tp;
  spec.batches = o.sweep_batch;
  if (o.overlap != "dispatch") spec.overlaps = {in.work.overlap};
  std::vector<SweepPoint> pts;
  std::vector<SkippedLayout> skipped;
  std::vector<std::string> names;
  for (const auto& g : gpus) {
    PlanInput base = in;
    base.gpu = g;
    base.layout.gpus_per_node = gpus_per_node(o, g);
    auto p = sweep(base, spec, &skipped);
    pts.insert(pts.end(), p.begin(), p.end());
    names.push_back(g.name);
  }
  if (pts.empty())
    throw PlanError("no swept layout is valid and fits in memory for " + in.model.name + "\n" +
                    format_skipped(skipped));
  const bool several = gpus.size() > 1;
  const bool table = o.json_out.empty() && o.csv_out.empty();
  if (table) {
    std::printf("%s on %s, %s, KV %d tokens, query length %d: Pareto frontiers (throughput per node vs output "
                "speed, tok/s)\n",
                in.model.name.c_str(), join(names, " and ").c_str(), in.net.name.c_str(), o.kv_len,
                in.work.query_len());
    for (const auto& [key, f] : frontiers_by_gpu_and_ep(pts)) {
      std::printf("\n%s\n", frontier_name(key, several).c_str());
      std::fputs(format_sweep_table(f).c_str(), stdout);
    }
    if (o.target > 0) print_best(pts, o.target, several);
    if (!skipped.empty()) std::printf("\n%s", format_skipped(skipped).c_str());
  } else if (!skipped.empty()) {
    // stdout may carry the JSON/CSV: the list goes to stderr (and into the JSON).
    std::fprintf(stderr, "moelink-plan: note: %s", format_skipped(skipped).c_str());
  }
  if (!o.json_out.empty()) write_out(o.json_out, sweep_json(pts, skipped));
  if (!o.csv_out.empty()) write_out(o.csv_out, sweep_csv(pts));
  if (!o.svg_dir.empty())
    write_out(o.svg_dir + "/pareto.svg",
              svg_pareto(pts, in.model.name + " on " + join(names, " vs ") + ": Pareto frontier per " +
                                  (several ? "GPU and EP size" : "EP size")));
  return 0;
}

// Why a --calibrate file leaves the plan's times modelled, "" when it applies.
std::string calibration_note(const PlanInput& in, const Calibration& cal) {
  if (cal.format == Calibration::Format::kAttentionBench) {
    const std::string why =
        cal.attention_mismatch(long(in.model.hidden), int(in.model.kv_lora_rank),
                               int(in.model.num_heads / in.layout.tp), in.work.query_len(), in.work.kv_len);
    return why.empty() ? ""
                       : "--calibrate " + cal.source + " does not apply to the attention of " + in.layout.str() +
                             " of " + in.model.name + ": " + why + "; the model's times are used\n";
  }
  const std::string why = cal.mismatch(in.layout.ep, long(in.model.hidden), int(in.model.num_experts));
  if (why.empty()) return "";
  if (in.layout.ep > 1 && cal.stand_in_ep(long(in.model.hidden), int(in.model.num_experts)) == in.layout.ep)
    return "--calibrate " + cal.source + " stands in for one rank of " + in.layout.str() + " of " +
           in.model.name + " (" + std::to_string(cal.experts) + " of its " +
           std::to_string(in.model.num_experts) +
           " routed experts on one GPU): its experts' and shared expert's kernels are measured; the router, "
           "dispatch and combine stay modelled\n";
  return "--calibrate " + cal.source + " does not apply to " + in.layout.str() + " of " + in.model.name + ": " +
         why + "; the model's times are used\n";
}

int run_plan(const Options& o, const PlanInput& in) {
  const std::string why = layout_problem(in.layout, in.model, in.net);
  if (!why.empty())
    throw PlanError("layout " + in.layout.str() + " (--ep " + std::to_string(o.ep) + ", --tp " +
                    std::to_string(o.tp) + "): " + why);
  const MemoryReport mem = memory_report(in.model, in.gpu, in.layout, in.work);
  if (!o.ignore_memory) require_fits(mem, in.layout, in.work, in.gpu.name);
  const StepResult r = simulate_step(in);
  const bool table = o.json_out.empty() && o.csv_out.empty();
  if (table) std::fputs(format_step_table(in, r, mem).c_str(), stdout);
  if (!o.json_out.empty()) write_out(o.json_out, step_json(in, r, mem));
  if (!o.csv_out.empty()) write_out(o.csv_out, step_csv(in, r));
  for (const Calibration* cal : in.calibrations) {
    const std::string note = calibration_note(in, *cal);
    if (!table) {
      // stdout may carry the JSON/CSV (whose kernels say "measured").
      if (!note.empty()) std::fprintf(stderr, "moelink-plan: note: %s", note.c_str());
      continue;
    }
    if (!note.empty()) std::printf("\nnote: %s", note.c_str());
    std::printf("\n%s", format_calibration(compare_calibration(in, *cal), *cal,
                                            cal->stand_in_ep(long(in.model.hidden), int(in.model.num_experts)))
                             .c_str());
  }
  if (!o.svg_dir.empty()) {
    std::vector<std::pair<std::string, LayerTiming>> bars;
    for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kDispatchOverlap, OverlapMode::kMicroBatch}) {
      PlanInput x = in;
      x.work.overlap = m;
      bars.push_back({in.layout.str() + " " + to_string(m), layer_timing(x, o.batch, x.work.query_len(), true)});
    }
    write_out(o.svg_dir + "/breakdown.svg", svg_breakdown(bars, in.model.name + " MoE layer on " + in.gpu.name +
                                                                    ", batch " + std::to_string(o.batch)));
    write_out(o.svg_dir + "/roofline.svg",
              svg_roofline(in.gpu, {{in.layout.str() + " b" + std::to_string(o.batch), r.moe_layer.kernels}},
                           "Roofline of " + in.gpu.name + " with the MoE layer kernels"));
  }
  return 0;
}

int run(const Options& o) {
  ProfileStore store(o.profiles_dir);
  if (o.list) {
    std::printf("models:   %s\ngpus:     %s\nnetworks: %s\n(profiles in %s)\n", join(store.models()).c_str(),
                join(store.gpus()).c_str(), join(store.networks()).c_str(), store.dir().c_str());
    return 0;
  }
  if (!o.sweep) check_split(o);
  const std::vector<GpuProfile> gpus = load_gpus(o, store);
  PlanInput in;
  in.model = for_option("--model", [&] { return store.model(o.model); });
  in.gpu = gpus.front();
  in.layout = {o.ep, o.dp > 0 ? o.dp : o.ep / o.tp, o.tp, gpus_per_node(o, in.gpu)};
  in.net = pick_network(o, store, gpus);
  in.work = {o.batch, o.kv_len, o.mtp, o.acceptance, overlap_from_string(o.overlap)};
  std::vector<Calibration> cals;
  for (const auto& path : o.calibrate)
    cals.push_back(for_option("--calibrate", [&] { return Calibration::from_file(path); }));
  for (const auto& cal : cals) in.calibrations.push_back(&cal);
  if (!o.svg_dir.empty()) std::filesystem::create_directories(o.svg_dir);
  return o.sweep ? run_sweep(o, in, gpus) : run_plan(o, in);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moelink-plan: deployment planner for MoE decode (roofline, overlap, Pareto frontiers)"};
  app.set_version_flag("--version", std::string("moelink-plan ") + moelink::version());
  Options o;
  add_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2, as documented
    // (CLI11's own codes, 104 for a bad number and so on, are not).
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "moelink-plan: error: %s\n(moelink-plan --help lists the options with units and ranges)\n",
                 e.what());
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-plan: error: %s\n", e.what());
    return 2;
  }
}
