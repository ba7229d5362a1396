#include "moelink/plan/calibration.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

#include "moelink/plan/model.h"
#include "moelink/plan/profiles.h"

namespace moelink::plan {
namespace {
using nlohmann::json;

constexpr const char* kLayerBenchTool = "tools/bench/layer_bench.py";
constexpr const char* kAttentionBenchTool = "tools/bench/attention_bench.py";

// The stages of layer_bench.py (MoEStageTimes) summed into what they
// calibrate. The planner has no kernel that quantizes the layer's input (its
// dispatch sends fp8 rows as they are), so the quantize stage counts with dispatch.
struct StageMap {
  const char* name;
  std::vector<const char*> stages;
};
const StageMap kLayerStages[] = {
    {"router", {"router_us"}},
    {"shared_expert", {"shared_expert_us"}},
    {"dispatch", {"quantize_us", "dispatch_send_us", "dispatch_recv_us"}},
    {"moe_gate_up", {"gemm1_us"}},
    {"moe_act_quant", {"silu_mul_us"}},
    {"moe_down", {"gemm2_us"}},
    {"combine", {"combine_send_us", "combine_recv_us"}},
};

bool is_layer_bench(const json& j) {
  if (j.contains("tool") && j["tool"] == kLayerBenchTool) return true;
  if (j.contains("results") && j["results"].is_array())
    for (const auto& r : j["results"])
      if (r.is_object() && r.contains("stages_us")) return true;
  return false;
}

// An integer field of a bench's model object (Hugging Face names): the
// layer bench's "model", the attention bench's "fields".
long model_field(const json& model, const std::string& object, const std::string& field, const std::string& err) {
  if (model.is_object() && model.contains(field) && model[field].is_number_integer() &&
      model[field].get<long>() > 0)
    return model[field].get<long>();
  throw PlanError(err + "no positive integer " + object + "." + field + " (\"" + object +
                  "\" names the benchmarked model's shape)");
}

// attention_bench.py --step-kernels: per case, the whole step's busy GPU
// time with the decode kernel the model runs by default (FlashInfer's where
// the run had it, else moelink's).
void parse_attention_bench(const json& j, Calibration& c) {
  const std::string err = "attention bench results '" + c.source + "': ";
  c.format = Calibration::Format::kAttentionBench;
  c.world_size = 1;
  const json fields = j.value("fields", json());
  c.hidden_dim = model_field(fields, "fields", "hidden_size", err);
  c.kv_lora_rank = int(model_field(fields, "fields", "kv_lora_rank", err));
  if (!j.contains("results") || !j["results"].is_array())
    throw PlanError(err + "no \"results\" array");
  std::map<std::tuple<int, int, int, double>, BenchSample> cases;
  const json& results = j["results"];
  for (size_t i = 0; i < results.size(); ++i) {
    const json& r = results[i];
    const std::string at = "results[" + std::to_string(i) + "]";
    if (!r.is_object()) throw PlanError(err + at + " is not an object");
    BenchSample s;
    for (const char* kernel : {"flashinfer", "moelink"}) {
      const json k = r.value(std::string(kernel) + "_step_kernels", json());
      if (k.is_object() && k.contains("busy_us") && k["busy_us"].is_number() && k["busy_us"].get<double>() > 0) {
        s.mode = kernel;
        s.us[Calibration::kAttentionStep] = k["busy_us"].get<double>();
        break;
      }
    }
    if (s.mode.empty()) continue;  // a run without --step-kernels, or the case had neither kernel
    auto positive = [&](const char* field) {
      if (!r.contains(field) || !r[field].is_number_integer() || r[field].get<long>() <= 0)
        throw PlanError(err + at + "." + field + ": missing or not a positive integer");
      return r[field].get<int>();
    };
    s.heads = positive("heads");
    s.query_len = positive("q_len");
    s.kv_len = positive("kv_len");
    s.tokens = positive("batch");
    cases[{s.heads, s.query_len, s.kv_len, s.tokens}] = s;  // a repeated case: the later one
  }
  if (cases.empty())
    throw PlanError(err + "no result with flashinfer_step_kernels or moelink_step_kernels busy_us "
                    "(attention_bench.py --step-kernels writes them)");
  for (auto& [key, s] : cases) c.samples.push_back(s);
}

// Log-log interpolation of (x, y) points sorted by x; clamped below the
// range, extrapolated linearly above it (the last segment's slope, never
// decreasing).
double interpolate(const std::vector<std::pair<double, double>>& v, double x) {
  if (v.size() == 1 || x <= v.front().first) return v.front().second;
  if (x >= v.back().first) {
    const auto& a = v[v.size() - 2];
    const auto& b = v.back();
    const double slope = (b.second - a.second) / (b.first - a.first);
    return b.second + std::max(0.0, slope) * (x - b.first);
  }
  for (size_t i = 1; i < v.size(); ++i) {
    if (x <= v[i].first) {
      const auto& a = v[i - 1];
      const auto& b = v[i];
      const double f = std::log(x / a.first) / std::log(b.first / a.first);
      return std::exp(std::log(a.second) + f * (std::log(b.second) - std::log(a.second)));
    }
  }
  return v.back().second;
}

void parse_moelink_bench(const json& j, Calibration& c) {
  const std::string err = "bench results '" + c.source + "': ";
  c.world_size = j.value("world_size", 0);
  if (j.contains("config")) {
    const auto& cfg = j["config"];
    c.hidden_dim = cfg.value("hidden_dim", 0L);
    c.experts = cfg.value("num_experts", 0);
    c.topk = cfg.value("experts_per_token", 0);
  }
  if (!j.contains("results") || !j["results"].is_array())
    throw PlanError(err + "no \"results\" array (is it moelink-bench --json or layer_bench.py --json output?)");
  for (const auto& r : j["results"]) {
    if (!r.is_object() || !r.contains("quantities")) continue;
    const auto& q = r["quantities"];
    if (!q.contains("dispatch") || !q.contains("combine")) continue;
    BenchSample s;
    s.tokens = r.value("tokens", 0.0);
    s.us["dispatch"] = q["dispatch"].value("p50_us", 0.0);
    s.us["combine"] = q["combine"].value("p50_us", 0.0);
    if (s.tokens > 0 && s.us["dispatch"] > 0 && s.us["combine"] > 0) c.samples.push_back(s);
  }
  if (c.samples.empty()) throw PlanError(err + "no result with dispatch and combine p50_us");
  if (c.world_size <= 0) throw PlanError(err + "no world_size");
}

void parse_layer_bench(const json& j, Calibration& c) {
  const std::string err = "layer bench results '" + c.source + "': ";
  c.format = Calibration::Format::kLayerBench;
  c.world_size = j.value("world_size", 1);  // layer_bench.py runs one process
  const json model = j.value("model", json());
  c.hidden_dim = model_field(model, "model", "hidden_size", err);
  c.experts = int(model_field(model, "model", "n_routed_experts", err));
  if (model.is_object()) c.topk = model.value("num_experts_per_tok", 0);
  if (!j.contains("results") || !j["results"].is_array() || j["results"].empty())
    throw PlanError(err + "no \"results\" (an array of the measured batches)");
  // One sample per batch: the eager run of mode "none" (every stage in turn),
  // else "dispatch-overlap" (the shared expert between dispatch send and
  // receive; their sum is the same work). CUDA-graph runs carry no stages and
  // micro-batch runs only total_us.
  std::map<double, BenchSample> by_batch;
  const json& results = j["results"];
  for (size_t i = 0; i < results.size(); ++i) {
    const json& r = results[i];
    const std::string at = "results[" + std::to_string(i) + "]";
    if (!r.is_object()) throw PlanError(err + at + " is not an object");
    const json stages = r.value("stages_us", json());
    const std::string mode = r.value("mode", std::string());
    if (stages.is_null() || stages.empty() || r.value("graphs", false) ||
        (mode != "none" && mode != "dispatch-overlap"))
      continue;
    if (!stages.is_object()) throw PlanError(err + at + ".stages_us is not an object");
    if (!r.contains("batch") || !r["batch"].is_number() || r["batch"].get<double>() <= 0)
      throw PlanError(err + at + ".batch: missing or not a positive number (tokens per rank)");
    BenchSample s;
    s.tokens = r["batch"].get<double>();
    s.mode = mode;
    for (const auto& m : kLayerStages) {
      double sum = 0;
      for (const char* stage : m.stages) {
        if (!stages.contains(stage) || !stages[stage].is_number() || stages[stage].get<double>() < 0)
          throw PlanError(err + at + ".stages_us." + stage + ": missing or not a number >= 0 (us)");
        sum += stages[stage].get<double>();
      }
      s.us[m.name] = sum;
    }
    auto [it, added] = by_batch.emplace(s.tokens, s);
    if (!added && it->second.mode != "none") it->second = s;
  }
  if (by_batch.empty())
    throw PlanError(err + "no usable stage times: none of the " + std::to_string(results.size()) +
                    " results is an eager run (\"graphs\": false) of mode \"none\" or \"dispatch-overlap\" "
                    "with non-empty \"stages_us\"");
  for (auto& [tokens, s] : by_batch) c.samples.push_back(s);
}
}  // namespace

Calibration Calibration::from_json_text(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw PlanError("bench results '" + source + "': not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw PlanError("bench results '" + source + "': not a JSON object (moelink-bench or layer_bench.py output)");
  Calibration c;
  c.source = source;
  c.machine = j.value("machine", std::string());
  c.date = j.value("date", std::string());
  if (j.contains("tool") && j["tool"] == kAttentionBenchTool)
    parse_attention_bench(j, c);
  else if (is_layer_bench(j))
    parse_layer_bench(j, c);
  else
    parse_moelink_bench(j, c);
  std::sort(c.samples.begin(), c.samples.end(),
            [](const BenchSample& a, const BenchSample& b) { return a.tokens < b.tokens; });
  return c;
}

Calibration Calibration::from_file(const std::string& path) { return from_json_text(read_text_file(path), path); }

std::string Calibration::mismatch(int ep, long hidden, int num_experts) const {
  if (format == Format::kAttentionBench)
    return "an attention bench file calibrates the attention step, not the MoE layer's kernels";
  if (ep != world_size)
    return "measured on " + std::to_string(world_size) + " rank(s), the layout has EP " + std::to_string(ep);
  if (hidden != hidden_dim)
    return "measured at hidden size " + std::to_string(hidden_dim) + ", the model's is " + std::to_string(hidden);
  if (format == Format::kLayerBench && num_experts != experts)
    return "measured with " + std::to_string(experts) + " routed experts, the model has " +
           std::to_string(num_experts);
  return "";
}

int Calibration::stand_in_ep(long hidden, int num_experts) const {
  if (format != Format::kLayerBench || world_size != 1 || hidden != hidden_dim || experts <= 0 ||
      num_experts <= experts || num_experts % experts != 0)
    return 0;
  return num_experts / experts;
}

bool Calibration::rank_measured(const std::string& name) {
  return name == "moe_gate_up" || name == "moe_act_quant" || name == "moe_down" || name == "shared_expert";
}

bool Calibration::measures(const std::string& name) const {
  return !samples.empty() && std::all_of(samples.begin(), samples.end(), [&](const BenchSample& s) {
    auto it = s.us.find(name);
    return it != s.us.end() && it->second > 0;
  });
}

double Calibration::us(const std::string& name, double tokens) const {
  if (format == Format::kAttentionBench || !measures(name))
    throw PlanError("bench results '" + source + "': no measured " + name);
  std::vector<std::pair<double, double>> v;
  for (const auto& s : samples) v.push_back({s.tokens, s.us.at(name)});
  return interpolate(v, tokens);
}

std::string Calibration::attention_mismatch(long hidden, int latent, int local_heads, int query_len,
                                            int kv_len) const {
  if (format != Format::kAttentionBench) return "not an attention bench file";
  if (hidden != hidden_dim)
    return "measured at hidden size " + std::to_string(hidden_dim) + ", the model's is " + std::to_string(hidden);
  if (latent != kv_lora_rank)
    return "measured at kv_lora_rank " + std::to_string(kv_lora_rank) + ", the model's is " +
           std::to_string(latent) + (latent == 0 ? " (no MLA)" : "");
  std::set<std::string> cases;
  for (const auto& s : samples) {
    if (s.is_case(local_heads, query_len, kv_len)) return "";
    cases.insert(std::to_string(s.heads) + " heads q_len " + std::to_string(s.query_len) + " kv " +
                 std::to_string(s.kv_len));
  }
  std::string list;
  for (const auto& c : cases) list += (list.empty() ? "" : ", ") + c;
  return "no case at " + std::to_string(local_heads) + " heads per GPU, q_len " + std::to_string(query_len) +
         ", kv " + std::to_string(kv_len) + " (measured: " + list + ")";
}

double Calibration::attention_us(int local_heads, int query_len, int kv_len, double batch) const {
  std::vector<std::pair<double, double>> v;  // samples are sorted by tokens (requests)
  for (const auto& s : samples)
    if (s.is_case(local_heads, query_len, kv_len)) v.push_back({s.tokens, s.us.at(kAttentionStep)});
  if (v.empty())
    throw PlanError("attention bench results '" + source + "': no case at " + std::to_string(local_heads) +
                    " heads, q_len " + std::to_string(query_len) + ", kv " + std::to_string(kv_len));
  return interpolate(v, batch);
}

bool Calibration::attention_step_kernel(const std::string& name) {
  static const std::set<std::string> step{"input_norm", "qkv_a_proj", "q_kv_a_norm", "q_b_proj", "k_b_absorb",
                                          "rope_append_kv", "attention", "v_b_proj", "o_proj"};
  return step.count(name) != 0;
}

void Calibration::apply_attention(std::vector<Kernel>& kernels, int local_heads, int query_len, int kv_len,
                                  double batch) const {
  double modelled = 0;
  for (const auto& k : kernels)
    if (attention_step_kernel(k.name)) modelled += k.time_us;
  if (modelled <= 0) return;
  const double measured = attention_us(local_heads, query_len, kv_len, batch);
  for (auto& k : kernels) {
    if (!attention_step_kernel(k.name)) continue;
    k.time_us = measured * k.time_us / modelled;
    k.measured = true;
  }
}

std::string Calibration::measured_name(const std::string& kernel) {
  return kernel.rfind("shared_", 0) == 0 ? "shared_expert" : kernel;
}

void Calibration::apply(std::vector<Kernel>& kernels, double tokens, bool rank_only,
                        const KernelModel& model_at) const {
  std::map<std::string, double> modelled;  // per measured name, before any is replaced
  for (const auto& k : kernels) modelled[measured_name(k.name)] += k.time_us;
  // Past the largest sample: the model alone at `tokens` and at that sample
  // (not the kernels as an earlier file may have replaced them).
  std::map<std::string, double> model_now, model_last;
  const bool past = model_at && !samples.empty() && tokens > samples.back().tokens;
  if (past) {
    for (const auto& k : model_at(tokens)) model_now[measured_name(k.name)] += k.time_us;
    for (const auto& k : model_at(samples.back().tokens)) model_last[measured_name(k.name)] += k.time_us;
  }
  for (auto& k : kernels) {
    const std::string name = measured_name(k.name);
    if (!measures(name) || (rank_only && !rank_measured(name))) continue;
    const double last = model_last[name];
    const double measured =
        past && last > 0 ? samples.back().us.at(name) * model_now[name] / last : us(name, tokens);
    k.time_us = measured * k.time_us / modelled[name];
    k.measured = true;
  }
}

void Calibration::apply(CommCost& c, const std::string& name, double tokens) const {
  if (!measures(name)) return;
  c.transfer_us = std::max(0.0, us(name, tokens) - c.send_us - c.recv_us);
  c.measured = true;
}

}  // namespace moelink::plan
