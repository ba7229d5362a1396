#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "moelink/plan/calibration.h"
#include "moelink/plan/memory.h"
#include "moelink/plan/report.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
const char* kBench = R"({"machine": "m", "date": "d", "world_size": 2,
  "config": {"hidden_dim": 7168, "num_experts": 256, "experts_per_token": 8},
  "results": [
   {"tokens": 128, "quantities": {"dispatch": {"p50_us": 25.0}, "combine": {"p50_us": 20.0}}},
   {"tokens": 1, "quantities": {"dispatch": {"p50_us": 15.0}, "combine": {"p50_us": 13.0}}},
   {"tokens": 4096, "quantities": {"dispatch": {"p50_us": 170.0}, "combine": {"p50_us": 275.0}}}]})";

const std::string kBenchFile = std::string(MOELINK_SOURCE_DIR) + "/bench/results/2026-11-30_nvidia-h200-x2.json";
// Hand-written tools/bench/layer_bench.py output (world 1, DeepSeek-V3 shapes).
const std::string kLayerFile = std::string(MOELINK_SOURCE_DIR) + "/tests/plan/data/layer_bench_sample.json";

// One eager mode-"none" result with every stage at `us` (gemm1_us at `gemm1`).
std::string layer_result(int batch, double us, double gemm1) {
  nlohmann::json st;
  for (const char* k : {"quantize_us", "router_us", "dispatch_send_us", "shared_expert_us", "dispatch_recv_us",
                        "silu_mul_us", "gemm2_us", "combine_send_us", "combine_recv_us"})
    st[k] = us;
  st["gemm1_us"] = gemm1;
  return nlohmann::json{{"batch", batch}, {"mode", "none"}, {"graphs", false}, {"stages_us", st}}.dump();
}

const Kernel& kernel(const LayerTiming& t, const std::string& name) {
  for (const auto& k : t.kernels)
    if (k.name == name) return k;
  throw std::runtime_error("no kernel " + name);
}

// EP1 at 128 tokens per rank (batch 64, one draft token), overlap none.
PlanInput ep1_input(int batch = 64, OverlapMode ov = OverlapMode::kNone) {
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {1, 1, 1, 8}, batch, ov);
  in.work.draft_tokens = 1;
  return in;
}

// The PlanError message of parsing `text` ("" if it parses).
std::string parse_error(const std::string& text) {
  try {
    Calibration::from_json_text(text, "f.json");
  } catch (const PlanError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PlanCalibration, ParsesAndInterpolates) {
  Calibration c = Calibration::from_json_text(kBench, "t");
  EXPECT_EQ(c.format, Calibration::Format::kMoelinkBench);
  ASSERT_EQ(c.samples.size(), 3u);
  EXPECT_EQ(c.samples[0].tokens, 1);
  EXPECT_DOUBLE_EQ(c.dispatch_us(1), 15);
  EXPECT_DOUBLE_EQ(c.dispatch_us(0.5), 15);
  EXPECT_DOUBLE_EQ(c.combine_us(128), 20);
  const double mid = c.dispatch_us(std::sqrt(128.0));  // log-log midpoint
  EXPECT_NEAR(mid, std::sqrt(15.0 * 25.0), 1e-9);
  EXPECT_GT(c.combine_us(8192), 275);
  EXPECT_TRUE(c.measures("dispatch"));
  EXPECT_FALSE(c.measures("moe_gate_up"));
  EXPECT_TRUE(c.applies(2, 7168, 256));
  EXPECT_TRUE(c.applies(2, 7168, 384));  // dispatch/combine: the expert count is not checked
  EXPECT_FALSE(c.applies(8, 7168, 256));
  EXPECT_FALSE(c.applies(2, 4096, 256));
  EXPECT_THROW(Calibration::from_json_text("{\"results\": []}", "x"), PlanError);
  EXPECT_THROW(Calibration::from_json_text("[", "x"), PlanError);
}

TEST(PlanCalibration, RealBenchFileReplacesTheModel) {
  Calibration c = Calibration::from_file(kBenchFile);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.hidden_dim, 7168);
  EXPECT_EQ(c.machine, "nvidia-h200-x2");
  EXPECT_EQ(c.samples.size(), 3u);
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {2, 2, 1, 8}, 64);
  in.work.draft_tokens = 1;  // 128 tokens per rank
  StepResult model = simulate_step(in);
  in.calibrations = {&c};
  StepResult meas = simulate_step(in);
  EXPECT_FALSE(model.moe_layer.dispatch.measured);
  EXPECT_TRUE(meas.moe_layer.dispatch.measured);
  EXPECT_NEAR(meas.moe_layer.dispatch.total_us(), c.dispatch_us(128), 1e-6);
  EXPECT_NEAR(meas.moe_layer.combine.total_us(), c.combine_us(128), 1e-6);
  for (const auto& k : meas.moe_layer.kernels) EXPECT_FALSE(k.measured) << k.name;  // compute stays modelled
  // Not applied to another EP size.
  in.layout = {8, 8, 1, 8};
  EXPECT_FALSE(simulate_step(in).moe_layer.dispatch.measured);
  // Model vs measurement: dispatch, combine and their sum per bench point, same order of magnitude.
  auto rows = compare_calibration(in, c);
  ASSERT_EQ(rows.size(), 9u);
  EXPECT_EQ(rows[0].kernel, "dispatch");
  EXPECT_EQ(rows[1].kernel, "combine");
  EXPECT_EQ(rows[2].kernel, "sum");
  EXPECT_DOUBLE_EQ(rows[2].measured_us, rows[0].measured_us + rows[1].measured_us);
  for (const auto& r : rows) {
    EXPECT_GT(r.model_us / r.measured_us, 0.25) << r.tokens << " " << r.kernel;
    EXPECT_LT(r.model_us / r.measured_us, 4) << r.tokens << " " << r.kernel;
  }
  EXPECT_NE(format_calibration(rows, c).find("nvidia-h200-x2"), std::string::npos);
}

TEST(PlanCalibration, ParsesLayerBench) {
  Calibration c = Calibration::from_file(kLayerFile);
  EXPECT_EQ(c.format, Calibration::Format::kLayerBench);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.hidden_dim, 7168);
  EXPECT_EQ(c.experts, 256);
  EXPECT_EQ(c.machine, "hand-written");
  // One sample per batch; CUDA-graph and micro-batch runs are left out.
  ASSERT_EQ(c.samples.size(), 4u);
  EXPECT_EQ(c.samples[0].tokens, 1);
  EXPECT_EQ(c.samples[3].tokens, 4096);
  // Mode "none" wins over "dispatch-overlap" whatever the order in the file ...
  EXPECT_EQ(c.samples[1].mode, "none");
  EXPECT_DOUBLE_EQ(c.samples[1].us.at("moe_gate_up"), 800);
  const BenchSample& s = c.samples[2];
  EXPECT_EQ(s.mode, "none");
  EXPECT_DOUBLE_EQ(s.us.at("moe_gate_up"), 1900);
  // ... and "dispatch-overlap" is taken where no eager "none" run has stages.
  EXPECT_EQ(c.samples[3].mode, "dispatch-overlap");
  EXPECT_DOUBLE_EQ(c.samples[3].us.at("moe_gate_up"), 2300);
  // Stages summed into the planner's kernels: quantize counts with dispatch.
  EXPECT_DOUBLE_EQ(s.us.at("router"), 12);
  EXPECT_DOUBLE_EQ(s.us.at("shared_expert"), 30);
  EXPECT_DOUBLE_EQ(s.us.at("dispatch"), 5 + 10 + 9);
  EXPECT_DOUBLE_EQ(s.us.at("moe_act_quant"), 8);
  EXPECT_DOUBLE_EQ(s.us.at("moe_down"), 950);
  EXPECT_DOUBLE_EQ(s.us.at("combine"), 10 + 9);
  for (const char* k : {"router", "shared_expert", "dispatch", "moe_gate_up", "moe_act_quant", "moe_down", "combine"})
    EXPECT_TRUE(c.measures(k)) << k;
  EXPECT_EQ(c.mismatch(1, 7168, 256), "");
}

TEST(PlanCalibration, LayerBenchReplacesTheModel) {
  Calibration c = Calibration::from_file(kLayerFile);
  PlanInput in = ep1_input();  // 128 tokens per rank, a measured batch
  const StepResult model = simulate_step(in);
  in.calibrations = {&c};
  const StepResult meas = simulate_step(in);
  const LayerTiming& m = model.moe_layer;
  const LayerTiming& t = meas.moe_layer;
  for (const auto& [name, us] : std::vector<std::pair<std::string, double>>{
           {"router", 12}, {"moe_gate_up", 1900}, {"moe_act_quant", 8}, {"moe_down", 950}}) {
    EXPECT_DOUBLE_EQ(kernel(t, name).time_us, us) << name;
    EXPECT_TRUE(kernel(t, name).measured) << name;
    EXPECT_FALSE(kernel(m, name).measured) << name;
  }
  // The shared expert's stage is split over its kernels in the modelled proportions.
  const double shared = kernel(t, "shared_gate_up").time_us + kernel(t, "shared_act").time_us +
                        kernel(t, "shared_down").time_us;
  EXPECT_NEAR(shared, 30, 1e-9);
  EXPECT_NEAR(kernel(t, "shared_gate_up").time_us / kernel(t, "shared_down").time_us,
              kernel(m, "shared_gate_up").time_us / kernel(m, "shared_down").time_us, 1e-9);
  EXPECT_TRUE(kernel(t, "shared_act").measured);
  // Attention is not measured by the layer bench.
  EXPECT_FALSE(kernel(t, "attention").measured);
  EXPECT_DOUBLE_EQ(kernel(t, "attention").time_us, kernel(m, "attention").time_us);
  EXPECT_TRUE(t.dispatch.measured);
  EXPECT_NEAR(t.dispatch.total_us(), 24, 1e-9);
  EXPECT_NEAR(t.combine.total_us(), 19, 1e-9);
  EXPECT_NE(t.total_us, m.total_us);
  EXPECT_NE(meas.step_us, model.step_us);
  // The kernel table marks them.
  const std::string table = format_step_table(in, meas, memory_report(in.model, in.gpu, in.layout, in.work));
  for (const char* name : {"router", "shared_down", "moe_gate_up", "moe_down"}) {
    const size_t at = table.find("\n  " + std::string(name) + " ");
    ASSERT_NE(at, std::string::npos) << name;
    EXPECT_NE(table.substr(at, table.find('\n', at + 1) - at).find("[measured]"), std::string::npos) << name;
  }
  const size_t at = table.find("\n  attention ");
  EXPECT_EQ(table.substr(at, table.find('\n', at + 1) - at).find("[measured]"), std::string::npos);
}

TEST(PlanCalibration, LayerBenchInterpolatesInTokensPerRank) {
  Calibration c = Calibration::from_file(kLayerFile);
  // 16 x 2 = 32 tokens per rank, between the measured 16 (800 us) and 128 (1900 us): log-log.
  PlanInput in = ep1_input(16);
  in.calibrations = {&c};
  const double f = std::log(32.0 / 16) / std::log(128.0 / 16);  // 1/3
  const double expect = std::exp(std::log(800.0) + f * (std::log(1900.0) - std::log(800.0)));
  EXPECT_NEAR(kernel(simulate_step(in).moe_layer, "moe_gate_up").time_us, expect, 1e-9);
  EXPECT_NEAR(c.us("moe_gate_up", 32), expect, 1e-9);
  // Micro-batched, a kernel runs on half the tokens: batch 64 x 2 / 2 = 64 per rank.
  in = ep1_input(64, OverlapMode::kMicroBatch);
  in.calibrations = {&c};
  EXPECT_NEAR(kernel(simulate_step(in).moe_layer, "moe_gate_up").time_us, c.us("moe_gate_up", 64), 1e-9);
  EXPECT_GT(c.us("moe_gate_up", 64), 800);
  EXPECT_LT(c.us("moe_gate_up", 64), 1900);
  // The MTP draft layer (query length 1: 64 tokens) is calibrated too.
  in = ep1_input(64);
  const double model_draft = simulate_step(in).draft_us;
  in.calibrations = {&c};
  EXPECT_NE(simulate_step(in).draft_us, model_draft);
}

TEST(PlanCalibration, LayerBenchPastItsLargestBatchKeepsThatBatchsRatioToTheModel) {
  const std::string text =
      R"x({"model": {"hidden_size": 7168, "n_routed_experts": 256, "num_experts_per_tok": 8}, "results": [)x" +
      layer_result(16, 10, 800) + "," + layer_result(128, 12, 1900) + "]}";
  Calibration c = Calibration::from_json_text(text, "to-128.json");
  // The model alone at 128 tokens per rank (batch 64 x 2) and at 256 (batch 128 x 2).
  const double model_128 = kernel(simulate_step(ep1_input(64)).moe_layer, "moe_gate_up").time_us;
  const double model_256 = kernel(simulate_step(ep1_input(128)).moe_layer, "moe_gate_up").time_us;
  PlanInput in = ep1_input(128);
  in.calibrations = {&c};
  const StepResult r = simulate_step(in);
  const Kernel& gate_up = kernel(r.moe_layer, "moe_gate_up");
  EXPECT_TRUE(gate_up.measured);
  EXPECT_NEAR(gate_up.time_us, 1900 * model_256 / model_128, 1e-9);
  // At world 1 nearly every expert is read from 128 tokens on: the model grows
  // far less than the straight line through the last two samples (us()).
  EXPECT_LT(gate_up.time_us, 0.8 * c.us("moe_gate_up", 256));
  EXPECT_GT(gate_up.time_us, 1900);
  // Inside the range nothing changed: 64 tokens per rank interpolate as before.
  in = ep1_input(32);
  in.calibrations = {&c};
  EXPECT_NEAR(kernel(simulate_step(in).moe_layer, "moe_gate_up").time_us, c.us("moe_gate_up", 64), 1e-9);
}

TEST(PlanCalibration, LayerBenchLeavesOtherLayoutsAndModelsModelled) {
  Calibration c = Calibration::from_file(kLayerFile);
  auto unchanged = [&](PlanInput in) {
    const StepResult model = simulate_step(in);
    in.calibrations = {&c};
    const StepResult meas = simulate_step(in);
    for (const auto& k : meas.moe_layer.kernels) EXPECT_FALSE(k.measured) << in.model.name << " " << k.name;
    EXPECT_FALSE(meas.moe_layer.dispatch.measured);
    EXPECT_DOUBLE_EQ(meas.step_us, model.step_us) << in.model.name << " " << in.layout.str();
  };
  PlanInput in = ep1_input();
  in.layout = {8, 8, 1, 8};  // EP 8, measured on one rank
  unchanged(in);
  EXPECT_NE(c.mismatch(8, 7168, 256).find("1 rank(s), the layout has EP 8"), std::string::npos);
  in = ep1_input();
  in.model = store().model("kimi-k2");  // same hidden size, 384 routed experts
  ASSERT_EQ(in.model.hidden, 7168);
  unchanged(in);
  EXPECT_NE(c.mismatch(1, 7168, 384).find("256 routed experts, the model has 384"), std::string::npos);
  in = ep1_input();
  in.model = store().model("qwen3-235b-a22b");
  unchanged(in);
  EXPECT_NE(c.mismatch(1, long(in.model.hidden), int(in.model.num_experts)).find("hidden size 7168"),
            std::string::npos);
}

TEST(PlanCalibration, LayerBenchWithoutToolFieldOrWorldSize) {
  // Without "tool", results carrying stages_us tell the format; without
  // world_size the file is one process's.
  const std::string text =
      R"x({"model": {"hidden_size": 7168, "n_routed_experts": 256, "num_experts_per_tok": 8}, "results": [)x" +
      layer_result(8, 10, 300) + "," + layer_result(64, 12, 1500) + "]}";
  Calibration c = Calibration::from_json_text(text, "no-tool.json");
  EXPECT_EQ(c.format, Calibration::Format::kLayerBench);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.hidden_dim, 7168);
  EXPECT_EQ(c.experts, 256);
  ASSERT_EQ(c.samples.size(), 2u);
  EXPECT_DOUBLE_EQ(c.us("dispatch", 8), 30);
  EXPECT_DOUBLE_EQ(c.us("moe_gate_up", 64), 1500);
}

TEST(PlanCalibration, LayerBenchErrorsNameFileAndField) {
  const std::string head = R"({"tool": "tools/bench/layer_bench.py", "model": {"hidden_size": 7168, "n_routed_experts": 256}, )";
  auto expect_error = [](const std::string& text, const std::string& part) {
    const std::string e = parse_error(text);
    EXPECT_NE(e.find("'f.json'"), std::string::npos) << e;
    EXPECT_NE(e.find(part), std::string::npos) << "expected '" << part << "' in: " << e;
  };
  expect_error("{\"tool\": ", "not valid JSON");
  expect_error("[1, 2]", "not a JSON object");
  expect_error(R"({"tool": "tools/bench/layer_bench.py", "model": {"hidden_size": 7168}, "results": []})",
               "model.n_routed_experts");
  expect_error(head + R"("results": []})", "no \"results\"");
  expect_error(head + R"("x": 1})", "no \"results\"");
  // Only CUDA-graph and micro-batch runs: nothing to calibrate with.
  expect_error(head + R"("results": [{"batch": 1, "mode": "none", "graphs": true, "stages_us": {}},
      {"batch": 1, "mode": "micro-batch", "graphs": false, "stages_us": {"total_us": 100}}]})",
               "no usable stage times");
  expect_error(head + R"("results": [{"batch": 1, "mode": "none", "graphs": false, "stages_us": {"router_us": 1}}]})",
               "results[0].stages_us.shared_expert_us");
  std::string r = layer_result(4, 5, 100);
  r.replace(r.find("\"gemm1_us\":100.0"), 16, "\"gemm1_us\":\"x\"");
  expect_error(head + R"("results": [)" + layer_result(1, 5, 50) + "," + r + "]}", "results[1].stages_us.gemm1_us");
  r = layer_result(4, 5, 100);
  r.replace(r.find("\"batch\":4"), 9, "\"batch\":0");
  expect_error(head + R"("results": [)" + r + "]}", "results[0].batch");
  // The moelink-bench format keeps its own errors.
  expect_error(R"({"world_size": 2, "results": [{"tokens": 1}]})", "no result with dispatch and combine p50_us");
}

TEST(PlanCalibration, BothFormatsTogetherLaterWins) {
  Calibration bench = Calibration::from_json_text(kBench, "bench.json");  // world 2: dispatch 25 us at 128
  const std::string text = std::string(R"({"tool": "tools/bench/layer_bench.py", "world_size": 2, )") +
                           R"("model": {"hidden_size": 7168, "n_routed_experts": 256}, "results": [)" +
                           layer_result(1, 3, 60) + "," + layer_result(4096, 30, 2000) + "]}";
  Calibration layer = Calibration::from_json_text(text, "layer.json");
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {2, 2, 1, 8}, 64, OverlapMode::kNone);
  in.work.draft_tokens = 1;  // 128 tokens per rank
  in.calibrations = {&layer, &bench};
  LayerTiming t = simulate_step(in).moe_layer;
  EXPECT_NEAR(t.dispatch.total_us(), 25, 1e-9);  // the bench file, given last
  EXPECT_TRUE(kernel(t, "moe_gate_up").measured);  // the layer file, which alone measures it
  in.calibrations = {&bench, &layer};
  t = simulate_step(in).moe_layer;
  EXPECT_NEAR(t.dispatch.total_us(), layer.us("dispatch", 128), 1e-9);
  EXPECT_GT(layer.us("dispatch", 128), 9);  // 3 stages x 3 us at 1 token, more at 128
}

// layer_bench.py --experts 32: one process of 32 of DeepSeek-V3's 256
// experts stands in for one EP8 rank: its experts' and shared expert's
// kernels calibrate that rank; the router, dispatch and combine stay
// modelled; other EP sizes and EP1 are left alone.
TEST(PlanCalibration, LayerBenchStandsInForOneEpRank) {
  const std::string text =
      R"x({"tool": "tools/bench/layer_bench.py", "world_size": 1, "model": {"hidden_size": 7168,
          "n_routed_experts": 32, "num_experts_per_tok": 8, "model_n_routed_experts": 256}, "results": [)x" +
      layer_result(16, 10, 300) + "," + layer_result(128, 20, 700) + "]}";
  const Calibration c = Calibration::from_json_text(text, "rank.json");
  EXPECT_EQ(c.stand_in_ep(7168, 256), 8);
  EXPECT_EQ(c.stand_in_ep(7168, 32), 0);   // the same experts: a plain EP1 file
  EXPECT_EQ(c.stand_in_ep(7168, 384), 12);
  EXPECT_EQ(c.stand_in_ep(7168, 100), 0);  // not a whole number of ranks
  EXPECT_EQ(c.stand_in_ep(4096, 256), 0);  // another hidden size
  for (const char* k : {"moe_gate_up", "moe_act_quant", "moe_down", "shared_expert"})
    EXPECT_TRUE(Calibration::rank_measured(k)) << k;
  for (const char* k : {"router", "dispatch", "combine", "attention"})
    EXPECT_FALSE(Calibration::rank_measured(k)) << k;

  // EP8 at 128 tokens per rank (batch 64, one draft token).
  PlanInput in = input("deepseek-v3", "h200", "nvlink", {8, 8, 1, 8}, 64, OverlapMode::kNone);
  in.work.draft_tokens = 1;
  const StepResult model = simulate_step(in);
  in.calibrations = {&c};
  const StepResult meas = simulate_step(in);
  const LayerTiming& t = meas.moe_layer;
  EXPECT_DOUBLE_EQ(kernel(t, "moe_gate_up").time_us, 700);
  EXPECT_DOUBLE_EQ(kernel(t, "moe_down").time_us, 20);
  EXPECT_DOUBLE_EQ(kernel(t, "moe_act_quant").time_us, 20);
  EXPECT_NEAR(kernel(t, "shared_gate_up").time_us + kernel(t, "shared_act").time_us +
                  kernel(t, "shared_down").time_us,
              20, 1e-9);
  for (const char* k : {"moe_gate_up", "moe_act_quant", "moe_down", "shared_gate_up"})
    EXPECT_TRUE(kernel(t, k).measured) << k;
  EXPECT_FALSE(kernel(t, "router").measured);
  EXPECT_DOUBLE_EQ(kernel(t, "router").time_us, kernel(model.moe_layer, "router").time_us);
  EXPECT_FALSE(t.dispatch.measured);
  EXPECT_FALSE(t.combine.measured);
  EXPECT_DOUBLE_EQ(t.dispatch.total_us(), model.moe_layer.dispatch.total_us());
  // Another EP size, and EP1 (whose layer has all 256 experts), stay modelled.
  for (const Layout l : {Layout{4, 4, 1, 8}, Layout{1, 1, 1, 8}}) {
    PlanInput other = in;
    other.layout = l;
    for (const auto& k : simulate_step(other).moe_layer.kernels) EXPECT_FALSE(k.measured) << l.str() << " " << k.name;
  }
  // The comparison table is the EP8 rank's, on what the file measures.
  const auto rows = compare_calibration(in, c);
  ASSERT_EQ(rows.size(), 2u * 5);  // shared_expert, gate_up, act_quant, down, sum per batch
  EXPECT_EQ(rows[1].kernel, "moe_gate_up");
  EXPECT_EQ(rows[5 + 1].tokens, 128);
  EXPECT_NEAR(rows[5 + 1].model_us, kernel(model.moe_layer, "moe_gate_up").time_us, 1e-9);
  const std::string table = format_calibration(rows, c, 8);
  EXPECT_NE(table.find("at EP8 DP8 TP1 (one rank: the file stands in for it)"), std::string::npos) << table;
}

TEST(PlanCalibration, LayerBenchComparisonTable) {
  Calibration c = Calibration::from_file(kLayerFile);
  PlanInput in = ep1_input();
  const StepResult model = simulate_step(in);
  auto rows = compare_calibration(in, c);
  ASSERT_EQ(rows.size(), 4u * 8);  // 7 measured kernels and the sum, per batch
  const std::vector<std::string> order{"router", "shared_expert", "moe_gate_up", "moe_act_quant",
                                       "moe_down", "dispatch", "combine", "sum"};
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i].kernel, order[i % 8]) << i;
  // 128 tokens per rank is the plan's own point: the model side is the plan's modelled kernel.
  const CalibrationRow& g = rows[2 * 8 + 2];
  EXPECT_EQ(g.tokens, 128);
  EXPECT_EQ(g.mode, "none");
  EXPECT_DOUBLE_EQ(g.measured_us, 1900);
  EXPECT_NEAR(g.model_us, kernel(model.moe_layer, "moe_gate_up").time_us, 1e-9);
  const CalibrationRow& sh = rows[2 * 8 + 1];
  EXPECT_NEAR(sh.model_us,
              kernel(model.moe_layer, "shared_gate_up").time_us + kernel(model.moe_layer, "shared_act").time_us +
                  kernel(model.moe_layer, "shared_down").time_us,
              1e-9);
  EXPECT_NEAR(rows[2 * 8 + 5].model_us, model.moe_layer.dispatch.total_us(), 1e-9);
  EXPECT_DOUBLE_EQ(rows[2 * 8 + 7].measured_us, 2943);  // every stage but total_us
  EXPECT_EQ(rows[3 * 8].mode, "dispatch-overlap");
  const std::string s = format_calibration(rows, c);
  EXPECT_NE(s.find("layer_bench.py"), std::string::npos) << s;
  EXPECT_NE(s.find("meas/model"), std::string::npos) << s;
  char line[128];
  std::snprintf(line, sizeof line, "%-14s %9.1f %9.1f %10.2f", "moe_gate_up", g.model_us, 1900.0, 1900 / g.model_us);
  EXPECT_NE(s.find(line), std::string::npos) << line << "\n" << s;
}

TEST(PlanCalibration, CliTakesEitherFormatOrBoth) {
  const std::string base = "--ep 1 --batch 64 --ignore-memory --overlap none ";
  CliRun r = run(base + "--calibrate " + kLayerFile);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("[measured]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("meas/model"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("does not apply"), std::string::npos) << r.out;
  // Both files: the moelink-bench one (2 ranks) does not apply to EP1, and says so.
  r = run(base + "--calibrate " + kBenchFile + " --calibrate " + kLayerFile);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("note: --calibrate " + kBenchFile + " does not apply to EP1 DP1 TP1"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("moelink-bench"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layer_bench.py"), std::string::npos) << r.out;
  // JSON on stdout stays JSON; the note goes to stderr; kernels say "measured".
  r = run_split(base + "--json - --calibrate " + kLayerFile + " --calibrate " + kBenchFile);
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  bool measured = false;
  for (const auto& k : j["moe_layer"]["kernels"]) measured |= k["name"] == "moe_gate_up" && k["measured"] == true;
  EXPECT_TRUE(measured) << r.out;
  EXPECT_NE(r.err.find("does not apply"), std::string::npos) << r.err;
  // Errors name the option and the file.
  r = run(base + "--calibrate " + std::string(MOELINK_SOURCE_DIR) + "/profiles/gpus/h200.json");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--calibrate: bench results '"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("h200.json"), std::string::npos) << r.out;
}

namespace {
// A hand-written tools/bench/attention_bench.py --step-kernels record:
// DeepSeek-V3's attention at 128 and 16 heads, kv 5000, busy us per case.
std::string attention_row(int heads, int batch, int q_len, int kv, double flashinfer_busy, double moelink_busy) {
  nlohmann::json r{{"heads", heads}, {"batch", batch}, {"q_len", q_len}, {"kv_len", kv}};
  if (flashinfer_busy > 0) r["flashinfer_step_kernels"] = {{"busy_us", flashinfer_busy}, {"kernels", 12}};
  if (moelink_busy > 0) r["moelink_step_kernels"] = {{"busy_us", moelink_busy}, {"kernels", 14}};
  return r.dump();
}

std::string attention_file(const std::string& rows, const std::string& fields =
                                                         R"({"hidden_size": 7168, "kv_lora_rank": 512})") {
  return R"({"tool": "tools/bench/attention_bench.py", "machine": "hand-written", "date": "2026-12-07",
             "fields": )" +
         fields + R"(, "results": [)" + rows + "]}";
}

const std::string kAttentionRows =
    attention_row(128, 1, 1, 5000, 170, 260) + "," + attention_row(128, 32, 1, 5000, 260, 0) + "," +
    attention_row(128, 128, 1, 5000, 515, 700) + "," + attention_row(128, 1, 2, 5000, 175, 0) + "," +
    attention_row(128, 128, 2, 5000, 830, 0) + "," + attention_row(16, 8, 1, 5000, 0, 60) + "," +
    attention_row(16, 64, 1, 5000, 0, 90) + "," +
    R"({"heads": 128, "batch": 8, "q_len": 1, "kv_len": 1024, "moelink_us": 30.0})";  // no --step-kernels

double attention_step_us(const LayerTiming& t) {
  double us = 0;
  for (const auto& k : t.kernels)
    if (Calibration::attention_step_kernel(k.name)) us += k.time_us;
  return us;
}
}  // namespace

TEST(PlanCalibration, ParsesAttentionBench) {
  const Calibration c = Calibration::from_json_text(attention_file(kAttentionRows), "attn.json");
  EXPECT_EQ(c.format, Calibration::Format::kAttentionBench);
  EXPECT_EQ(c.hidden_dim, 7168);
  EXPECT_EQ(c.kv_lora_rank, 512);
  ASSERT_EQ(c.samples.size(), 7u);  // the row without step kernels is left out
  // FlashInfer's step where the case has it (the model's default decode), else moelink's.
  EXPECT_EQ(c.attention_us(128, 1, 5000, 128), 515);
  EXPECT_EQ(c.attention_us(16, 1, 5000, 64), 90);
  for (const auto& s : c.samples) EXPECT_EQ(s.mode, s.heads == 16 ? "moelink" : "flashinfer");
  // Log-log in requests between measured batches, clamped below, linear above.
  const double f = std::log(8.0 / 1) / std::log(32.0 / 1);
  EXPECT_NEAR(c.attention_us(128, 1, 5000, 8), std::exp(std::log(170.0) + f * (std::log(260.0) - std::log(170.0))),
              1e-9);
  EXPECT_EQ(c.attention_us(16, 1, 5000, 1), 60);
  EXPECT_NEAR(c.attention_us(128, 1, 5000, 256), 515 + (515 - 260) / 96.0 * 128, 1e-9);
  EXPECT_EQ(c.attention_mismatch(7168, 512, 128, 2, 5000), "");
  EXPECT_NE(c.attention_mismatch(7168, 512, 64, 1, 5000).find("no case at 64 heads per GPU, q_len 1, kv 5000 "
                                                              "(measured: 128 heads q_len 1 kv 5000, "),
            std::string::npos)
      << c.attention_mismatch(7168, 512, 64, 1, 5000);
  EXPECT_NE(c.attention_mismatch(4096, 512, 128, 1, 5000).find("hidden size 7168"), std::string::npos);
  EXPECT_NE(c.attention_mismatch(7168, 0, 128, 1, 5000).find("(no MLA)"), std::string::npos);
  // It never describes the MoE layer's kernels nor stands in for a rank.
  EXPECT_FALSE(c.applies(1, 7168, 256));
  EXPECT_EQ(c.stand_in_ep(7168, 256), 0);
  EXPECT_FALSE(c.measures("router"));
}

TEST(PlanCalibration, AttentionBenchCalibratesBothLayerKinds) {
  const Calibration c = Calibration::from_json_text(attention_file(kAttentionRows), "attn.json");
  // EP8, 128 requests of q_len 1 (a measured case) and of q_len 2.
  for (const int q : {1, 2}) {
    PlanInput in = input("deepseek-v3", "h100", "nvlink", {8, 8, 1, 8}, 128, OverlapMode::kDispatchOverlap);
    in.work.draft_tokens = q - 1;
    const StepResult model = simulate_step(in);
    in.calibrations = {&c};
    const StepResult meas = simulate_step(in);
    const double measured = q == 1 ? 515 : 830;
    for (const auto* pair : {&model.moe_layer, &model.dense_layer}) {
      const LayerTiming& m = *pair;
      const LayerTiming& t = pair == &model.moe_layer ? meas.moe_layer : meas.dense_layer;
      EXPECT_NEAR(attention_step_us(t), measured, 1e-9) << q;
      for (size_t i = 0; i < t.kernels.size(); ++i) {
        const Kernel& k = t.kernels[i];
        ASSERT_EQ(k.name, m.kernels[i].name);
        if (Calibration::attention_step_kernel(k.name)) {
          EXPECT_TRUE(k.measured) << k.name;  // split in the modelled proportions
          EXPECT_NEAR(k.time_us / measured, m.kernels[i].time_us / attention_step_us(m), 1e-9) << k.name;
        } else {
          EXPECT_FALSE(k.measured) << k.name;  // the norms after it, the MLP, the experts: modelled
          EXPECT_DOUBLE_EQ(k.time_us, m.kernels[i].time_us) << k.name;
        }
      }
      EXPECT_NEAR(t.total_us - m.total_us, measured - attention_step_us(m), 1e-6);
    }
    // With a draft token, the MTP draft layer (q_len 1) is calibrated too.
    if (q == 2) {
      EXPECT_NE(meas.draft_us, model.draft_us);
    }
  }
  // TP 8: 16 heads per GPU, from the 16-head cases (between 8 and 64 requests).
  PlanInput in = input("deepseek-v3", "h100", "nvlink", {8, 1, 8, 8}, 32, OverlapMode::kDispatchOverlap);
  in.work.draft_tokens = 0;
  in.calibrations = {&c};
  EXPECT_NEAR(attention_step_us(simulate_step(in).moe_layer), c.attention_us(16, 1, 5000, 32), 1e-9);
  // Micro-batched, a layer's attention runs on half the requests.
  in = input("deepseek-v3", "h100", "nvlink", {8, 8, 1, 8}, 64, OverlapMode::kMicroBatch);
  in.work.draft_tokens = 0;
  in.calibrations = {&c};
  EXPECT_NEAR(attention_step_us(simulate_step(in).moe_layer), c.attention_us(128, 1, 5000, 32), 1e-9);
}

TEST(PlanCalibration, AttentionBenchLeavesOtherCasesModelled) {
  const Calibration c = Calibration::from_json_text(attention_file(kAttentionRows), "attn.json");
  auto unchanged = [&](PlanInput in) {
    const StepResult model = simulate_step(in);
    in.calibrations = {&c};
    const StepResult meas = simulate_step(in);
    for (const auto& k : meas.moe_layer.kernels) EXPECT_FALSE(k.measured) << in.model.name << " " << k.name;
    EXPECT_DOUBLE_EQ(meas.step_us, model.step_us) << in.model.name << " " << in.layout.str();
  };
  PlanInput in = input("deepseek-v3", "h100", "nvlink", {8, 8, 1, 8}, 32, OverlapMode::kNone);
  in.work.kv_len = 1024;  // no case at that context
  unchanged(in);
  in = input("deepseek-v3", "h100", "nvlink", {4, 2, 2, 8}, 32, OverlapMode::kNone);  // 64 heads a GPU
  unchanged(in);
  in = input("qwen3-235b-a22b", "h100", "nvlink", {8, 8, 1, 8}, 32, OverlapMode::kNone);  // GQA
  unchanged(in);
}

TEST(PlanCalibration, AttentionBenchErrorsNameFileAndField) {
  EXPECT_NE(parse_error(attention_file(kAttentionRows, R"({"kv_lora_rank": 512})"))
                .find("attention bench results 'f.json': no positive integer fields.hidden_size"),
            std::string::npos);
  EXPECT_NE(parse_error(attention_file(R"({"heads": 128, "batch": 1, "q_len": 1, "kv_len": 5000})"))
                .find("no result with flashinfer_step_kernels or moelink_step_kernels busy_us "
                      "(attention_bench.py --step-kernels writes them)"),
            std::string::npos);
  EXPECT_NE(parse_error(attention_file(attention_row(128, 0, 1, 5000, 10, 0)))
                .find("results[0].batch: missing or not a positive integer"),
            std::string::npos);
  EXPECT_NE(parse_error(attention_file("[]")).find("results[0] is not an object"), std::string::npos);
}

TEST(PlanCalibration, AttentionBenchOnTheCommandLine) {
  const auto dir = scratch_dir("attention-calibration");
  const std::string path = (dir / "attn.json").string();
  {
    std::ofstream f(path);
    f << attention_file(kAttentionRows);
  }
  const std::string base = "--ep 8 --batch 128 --mtp 0 --kv-len 5000 --gpu h100 --ignore-memory --overlap dispatch ";
  CliRun r = run(base + "--calibrate " + path);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("attention_bench.py, hand-written"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("attention_step"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("does not apply"), std::string::npos) << r.out;
  const size_t at = r.out.find("\n  attention ");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NE(r.out.substr(at, r.out.find('\n', at + 1) - at).find("[measured]"), std::string::npos) << r.out;
  // Another context: said on stderr with the JSON on stdout, nothing measured.
  r = run_split("--ep 8 --batch 128 --mtp 0 --kv-len 2000 --gpu h100 --ignore-memory --json - --calibrate " + path);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("does not apply to the attention of EP8 DP8 TP1 of DeepSeek-V3: no case at 128 heads "
                       "per GPU, q_len 1, kv 2000"),
            std::string::npos)
      << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const auto& k : j["moe_layer"]["kernels"]) EXPECT_EQ(k["measured"], false);
}
