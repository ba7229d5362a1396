// moelink-plan: measured times that replace modelled ones, read from
// moelink-bench JSON (dispatch/combine latencies) or from
// tools/bench/layer_bench.py JSON (every kernel of the MoE layer).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "moelink/plan/cost.h"

namespace moelink::plan {

// Measured times at one token count per rank, keyed by what they calibrate:
// "dispatch", "combine", or (layer bench) a MoE-layer kernel of cost.cc
// ("router", "moe_gate_up", "moe_act_quant", "moe_down") or "shared_expert"
// (its three kernels together: the layer bench times them as one stage).
struct BenchSample {
  double tokens = 0;
  std::string mode;  // layer bench: overlap mode of the run ("none" or "dispatch-overlap")
  std::map<std::string, double> us;
};

class Calibration {
 public:
  enum class Format { kMoelinkBench, kLayerBench };
  // Either format; the layer bench's is told by "tool" or by results with "stages_us".
  static Calibration from_json_text(const std::string& text, const std::string& source);
  static Calibration from_file(const std::string& path);

  // Why the file does not describe a layout, "" when it does: EP must equal
  // the world size and the hidden size match; the layer bench also needs the
  // same routed-expert count (its GEMMs depend on it).
  std::string mismatch(int ep, long hidden, int experts) const;
  bool applies(int ep, long hidden, int experts) const { return mismatch(ep, hidden, experts).empty(); }
  // A layer bench run on one GPU with E / ep of a model's E routed experts
  // (layer_bench.py --experts) stands in for one rank of EP ep: every token
  // routed among its experts, each of them receives what an EP rank's
  // expert receives on average. The ep it stands in for (> 1), else 0. It
  // calibrates that rank's routed and shared experts' kernels
  // (rank_measured), not the router (its GEMM is the whole model's E wide)
  // nor dispatch and combine (local copies in that run).
  int stand_in_ep(long hidden, int experts) const;
  static bool rank_measured(const std::string& name);

  // Whether every sample has a positive time for `name` (a model without
  // shared experts, say, leaves "shared_expert" unmeasured).
  bool measures(const std::string& name) const;
  // Log-log interpolation in tokens per rank; clamped below the measured
  // range, extrapolated linearly in tokens above it.
  double us(const std::string& name, double tokens) const;
  double dispatch_us(double tokens) const { return us("dispatch", tokens); }
  double combine_us(double tokens) const { return us("combine", tokens); }

  // What a kernel of cost.cc is calibrated by: "shared_expert" for the
  // shared_* kernels, else its own name.
  static std::string measured_name(const std::string& kernel);
  // Replaces the times of the measured kernels at `tokens` per rank and marks
  // them (rank_only: only those a stand-in measures). A measured group (the
  // shared expert) is split in proportion to the modelled times of its kernels.
  void apply(std::vector<Kernel>& kernels, double tokens, bool rank_only = false) const;
  // Replaces the total of a dispatch or combine; send and receive kernels
  // keep their modelled time, the rest is transfer (what overlap can hide).
  void apply(CommCost& c, const std::string& name, double tokens) const;

  Format format = Format::kMoelinkBench;
  std::string source, machine, date;
  int world_size = 0;
  long hidden_dim = 0;
  int experts = 0, topk = 0;
  std::vector<BenchSample> samples;  // sorted by tokens
};

}  // namespace moelink::plan
