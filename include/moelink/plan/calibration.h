// moelink-plan: measured times that replace modelled ones, read from
// moelink-bench JSON (dispatch/combine latencies), from
// tools/bench/layer_bench.py JSON (every kernel of the MoE layer) or from
// tools/bench/attention_bench.py --step-kernels JSON (the attention step of
// every layer, dense and MoE).
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "moelink/plan/cost.h"

namespace moelink::plan {

// Measured times at one token count per rank, keyed by what they calibrate:
// "dispatch", "combine", or (layer bench) a MoE-layer kernel of cost.cc
// ("router", "moe_gate_up", "moe_act_quant", "moe_down") or "shared_expert"
// (its three kernels together: the layer bench times them as one stage).
// The attention bench's samples are keyed "attention_step" (its whole
// forward's busy GPU time) at `tokens` = requests of one case (heads,
// query_len, kv_len).
struct BenchSample {
  double tokens = 0;
  std::string mode;  // layer bench: overlap mode of the run ("none" or "dispatch-overlap");
                     // attention bench: the decode kernel timed ("flashinfer" or "moelink")
  std::map<std::string, double> us;
  int heads = 0, query_len = 0, kv_len = 0;  // attention bench: the case
  bool is_case(int h, int q, int kv) const { return heads == h && query_len == q && kv_len == kv; }
};

class Calibration {
 public:
  // The attention bench's samples' key (BenchSample::us).
  static constexpr const char* kAttentionStep = "attention_step";
  enum class Format { kMoelinkBench, kLayerBench, kAttentionBench };
  // Any format; the layer bench's is told by "tool" or by results with
  // "stages_us", the attention bench's by "tool".
  static Calibration from_json_text(const std::string& text, const std::string& source);
  static Calibration from_file(const std::string& path);

  // An attention bench file: why it does not describe a layer's attention
  // step, "" when it does: the same hidden size and latent width (MLA), and
  // cases at the layer's heads per GPU (the model's over TP), query length
  // and context length.
  std::string attention_mismatch(long hidden, int kv_lora_rank, int local_heads, int query_len,
                                 int kv_len) const;
  // The measured attention step at `batch` requests of that case (log-log
  // in requests, as us() is in tokens).
  double attention_us(int local_heads, int query_len, int kv_len, double batch) const;
  // The layer kernels of cost.cc that the attention bench's step runs (the
  // input norm, the projections, RoPE and AppendKV, the decode, o_proj).
  static bool attention_step_kernel(const std::string& name);
  // Replaces their times by the measured step, split in their modelled
  // proportions, and marks them.
  void apply_attention(std::vector<Kernel>& kernels, int local_heads, int query_len, int kv_len,
                       double batch) const;

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
  // The modelled kernels of the same layer at `tokens` per rank.
  using KernelModel = std::function<std::vector<Kernel>(double tokens)>;
  // Replaces the times of the measured kernels at `tokens` per rank and marks
  // them (rank_only: only those a stand-in measures). A measured group (the
  // shared expert) is split in proportion to the modelled times of its kernels.
  // Past the largest measured batch, given `model_at`, a kernel keeps the
  // measured / modelled ratio of that batch (the model knows where the
  // experts' weights stop growing: at 256 tokens of world 1 nearly every
  // expert is read already, where a straight line through the last two
  // samples keeps growing); without it, us()'s linear extension.
  void apply(std::vector<Kernel>& kernels, double tokens, bool rank_only = false,
             const KernelModel& model_at = {}) const;
  // Replaces the total of a dispatch or combine; send and receive kernels
  // keep their modelled time, the rest is transfer (what overlap can hide).
  void apply(CommCost& c, const std::string& name, double tokens) const;

  Format format = Format::kMoelinkBench;
  std::string source, machine, date;
  int world_size = 0;
  long hidden_dim = 0;
  int experts = 0, topk = 0;
  int kv_lora_rank = 0;  // attention bench
  std::vector<BenchSample> samples;  // sorted by tokens
};

}  // namespace moelink::plan
