#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moelink/plan/memory.h"
#include "moelink/plan/report.h"
#include "moelink/plan/svg.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
// Minimal well-formedness check: every element closes in order, attributes quoted.
bool well_formed(const std::string& s, std::string* why) {
  std::vector<std::string> stack;
  size_t i = 0;
  if (s.rfind("<?xml", 0) != 0) return *why = "no XML declaration", false;
  while ((i = s.find('<', i)) != std::string::npos) {
    size_t j = s.find('>', i);
    if (j == std::string::npos) return *why = "unterminated tag", false;
    std::string tag = s.substr(i + 1, j - i - 1);
    i = j + 1;
    if (tag[0] == '?' || tag[0] == '!') continue;
    if (std::count(tag.begin(), tag.end(), '"') % 2) return *why = "unbalanced quotes in <" + tag + ">", false;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return *why = "mismatched </" + tag.substr(1) + ">", false;
      stack.pop_back();
    } else if (tag.back() != '/') {
      stack.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
  }
  if (stack.size() != 0) return *why = "unclosed <" + stack.back() + ">", false;
  if (s.find("<svg") == std::string::npos) return *why = "no <svg>", false;
  return true;
}

}  // namespace

TEST(PlanOutput, StepJsonCsvTable) {
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 64);
  StepResult r = simulate_step(in);
  MemoryReport mem = memory_report(in.model, in.gpu, in.layout, in.work);
  auto j = nlohmann::json::parse(step_json(in, r, mem));
  EXPECT_EQ(j["layout"]["ep"], 128);
  EXPECT_NEAR(j["output_tok_s"].get<double>(), r.output_tok_s, 1e-9);
  EXPECT_NEAR(j["memory"]["kv_bytes_per_token"].get<double>(), 70272, 1e-9);
  EXPECT_EQ(j["moe_layer"]["kernels"].size(), r.moe_layer.kernels.size());
  std::string csv = step_csv(in, r);
  std::istringstream ss(csv);
  std::string line;
  std::getline(ss, line);
  const auto cols = std::count(line.begin(), line.end(), ',');
  int rows = 0;
  while (std::getline(ss, line)) {
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), cols) << line;
    ++rows;
  }
  EXPECT_GE(rows, int(r.moe_layer.kernels.size()) + 2);
  std::string t = format_step_table(in, r, mem);
  EXPECT_NE(t.find("GroupGEMM"), std::string::npos);
  EXPECT_NE(t.find("tok/s per request"), std::string::npos);
}

TEST(PlanOutput, SweepJsonAndCsv) {
  SweepSpec spec;
  spec.eps = {32, 64};
  spec.tps = {1, 2};
  spec.batches = {4, 32};
  auto pts = sweep(input("deepseek-v3", "h100", "ib-cx7", {64, 64, 1, 8}, 1), spec);
  auto j = nlohmann::json::parse(sweep_json(pts));
  EXPECT_EQ(j["points"].size(), pts.size());
  EXPECT_TRUE(j["frontiers"].contains("EP32"));
  EXPECT_TRUE(j["frontiers"].contains("EP64"));
  std::string csv = sweep_csv(pts);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), long(pts.size()) + 1);
  EXPECT_NE(csv.find(",1\n"), std::string::npos);  // some point on a frontier
}

TEST(PlanOutput, SvgWellFormed) {
  std::string why;
  SweepSpec spec;
  spec.eps = {16, 128};
  auto pts = sweep(input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 1), spec);
  std::string p = svg_pareto(pts, "Pareto <test> & \"quotes\"");
  EXPECT_TRUE(well_formed(p, &why)) << why;
  EXPECT_NE(p.find("EP128"), std::string::npos);
  EXPECT_NE(p.find("&lt;test&gt; &amp;"), std::string::npos);
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 128);
  LayerTiming t = layer_timing(in, 128, 2, true);
  EXPECT_TRUE(well_formed(svg_roofline(in.gpu, {{"EP128", t.kernels}}, "roof"), &why)) << why;
  EXPECT_TRUE(well_formed(svg_breakdown({{"a", t}, {"b", t}}, "bars"), &why)) << why;
  EXPECT_TRUE(well_formed(svg_chart({"empty", "x", "y", true, true}, {}), &why)) << why;
}

TEST(PlanCli, ErrorsAndOutputs) {
  CliRun r = run("--model no-such-model");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("valid: deepseek-r1, deepseek-v3, kimi-k2"), std::string::npos) << r.out;
  r = run("--gpu b200");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("h100, h200, h800"), std::string::npos) << r.out;
  r = run("--ep 8 --tp 1 --batch 128 --gpu h200");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("over by"), std::string::npos) << r.out;
  r = run("--ep 16 --network nvlink");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("NVLink only"), std::string::npos) << r.out;
  r = run("--list");
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("ib-cx7"), std::string::npos);
  r = run("--ep 128 --gpu h100 --batch 64 --json -");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["network"], "ib-cx7");
  const auto dir = std::filesystem::temp_directory_path() / ("moelink_plan_svg_" + std::to_string(getpid()));
  r = run("--ep 8 --tp 8 --batch 1 --svg-dir " + dir.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("Output speed"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(dir / "breakdown.svg"));
  EXPECT_TRUE(std::filesystem::exists(dir / "roofline.svg"));
  r = run("--sweep --gpu h100 --sweep-ep 64,128 --sweep-batch 8,64 --target 50 --svg-dir " + dir.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("EP128"), std::string::npos);
  EXPECT_NE(r.out.find("best at >= 50"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir / "pareto.svg"));
  r = run("--ep 2 --dp 2 --batch 64 --ignore-memory --calibrate " + std::string(MOELINK_SOURCE_DIR) +
          "/bench/results/2026-11-30_nvidia-h200-x2.json");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("[measured]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model vs measured"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}
