// The SVG charts: axes with tick labels, values printed as text, legends and
// labels inside the canvas, one tick style; and each renders to a PNG.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>

#include "moelink/plan/options.h"
#include "moelink/plan/svg.h"
#include "moelink/plan/sweep.h"
#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
struct Text {
  double x0, x1, y;  // estimated horizontal extent, baseline
  std::string s;
};
double attr(const std::string& attrs, const std::string& name, double fallback) {
  std::smatch m;
  if (std::regex_search(attrs, m, std::regex("\\b" + name + "=\"([-0-9.]+)\""))) return std::stod(m[1]);
  return fallback;
}
std::string unescape(std::string s) {
  for (auto [from, to] : {std::pair{"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&amp;", "&"}})
    for (size_t i; (i = s.find(from)) != std::string::npos;) s.replace(i, std::string(from).size(), to);
  return s;
}
// Every horizontal <text> with its extent estimated as the renderer's
// sans-serif at most 0.62 em per character (the rotated axis title is skipped).
std::vector<Text> texts(const std::string& svg) {
  std::vector<Text> out;
  const std::regex re("<text ([^>]*)>([^<]*)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), re); it != std::sregex_iterator(); ++it) {
    const std::string a = (*it)[1], s = unescape((*it)[2]);
    if (a.find("transform") != std::string::npos) continue;
    const double x = attr(a, "x", 0), font = attr(a, "font-size", 12), w = 0.62 * font * double(s.size());
    const double x0 = a.find("\"middle\"") != std::string::npos ? x - w / 2
                      : a.find("\"end\"") != std::string::npos  ? x - w
                                                                 : x;
    out.push_back({x0, x0 + w, attr(a, "y", 0), s});
  }
  return out;
}
std::pair<double, double> canvas(const std::string& svg) {
  std::smatch m;
  std::regex_search(svg, m, std::regex("<svg [^>]*width=\"([0-9]+)\" height=\"([0-9]+)\""));
  return {std::stod(m[1]), std::stod(m[2])};
}
bool has_text(const std::vector<Text>& ts, const std::string& s) {
  return std::any_of(ts.begin(), ts.end(), [&](const Text& t) { return t.s == s; });
}
void expect_inside_canvas(const std::string& svg, const char* chart) {
  const auto [w, h] = canvas(svg);
  for (const auto& t : texts(svg)) {
    EXPECT_GE(t.x0, 0) << chart << ": '" << t.s << "' starts left of the canvas";
    EXPECT_LE(t.x1, w) << chart << ": '" << t.s << "' runs past the right edge (" << t.x1 << " > " << w << ")";
    EXPECT_GE(t.y, 10) << chart << ": '" << t.s << "'";
    EXPECT_LE(t.y, h - 2) << chart << ": '" << t.s << "'";
  }
}
// Tick labels: plain numbers, never "1e+04" next to "1000".
void expect_plain_numbers(const std::string& svg, const char* chart) {
  for (const auto& t : texts(svg)) {
    EXPECT_EQ(t.s.find("e+"), std::string::npos) << chart << ": " << t.s;
    EXPECT_EQ(t.s.find("e-"), std::string::npos) << chart << ": " << t.s;
    if (std::regex_match(t.s, std::regex("[0-9]{4,}"))) ADD_FAILURE() << chart << ": no thousands separator: " << t.s;
  }
}

std::string num1(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

struct Charts {
  std::string breakdown, roofline, pareto;
  std::vector<std::pair<std::string, LayerTiming>> bars;
  std::vector<Kernel> kernels;
};
// The charts the CLI draws for EP128 on H100 at batch 128 and a two-GPU sweep.
Charts charts() {
  Charts c;
  PlanInput in = input("deepseek-v3", "h100", "ib-cx7", {128, 128, 1, 8}, 128);
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kDispatchOverlap, OverlapMode::kMicroBatch}) {
    in.work.overlap = m;
    c.bars.push_back({in.layout.str() + " " + to_string(m), layer_timing(in, 128, 2, true)});
  }
  c.breakdown = svg_breakdown(c.bars, "DeepSeek-V3 MoE layer on H100-SXM, batch 128");
  c.kernels = simulate_step(in).moe_layer.kernels;
  c.roofline = svg_roofline(in.gpu, {{"EP128 DP128 TP1 b128", c.kernels}}, "Roofline of H100-SXM");
  SweepSpec spec;
  spec.eps = {8, 128};
  auto pts = sweep(input("deepseek-v3", "h200", "ib-cx7", {8, 8, 1, 8}, 1), spec);
  const auto h100 = sweep(input("deepseek-v3", "h100", "ib-cx7", {8, 8, 1, 8}, 1), spec);
  pts.insert(pts.end(), h100.begin(), h100.end());
  c.pareto = svg_pareto(pts, "DeepSeek-V3 on H100-SXM vs H200-SXM");
  return c;
}
}  // namespace

// Issue 8: the breakdown had no axis and its values only as hover tooltips.
TEST(PlanCharts, BreakdownHasAxisAndValueLabels) {
  const Charts c = charts();
  const auto ts = texts(c.breakdown);
  EXPECT_TRUE(has_text(ts, "time per MoE layer per GPU (us; dispatch/combine as exposed)"));
  for (const char* tick : {"0", "500", "1,000", "1,500", "2,000", "2,500"}) EXPECT_TRUE(has_text(ts, tick)) << tick;
  // Every non-zero class time of every bar, and each total, printed as text.
  for (const auto& [label, t] : c.bars) {
    for (int k = 0; k < kNumKernelClasses; ++k) {
      if (t.class_us[k] > 0) {
        EXPECT_TRUE(has_text(ts, num1(t.class_us[k]))) << label << " " << to_string(KernelClass(k));
      }
    }
    EXPECT_TRUE(has_text(ts, num1(t.total_us) + " us")) << label;
    EXPECT_TRUE(has_text(ts, num1(t.total_us))) << label;  // table's total row
  }
  // The large segments carry their value on the bar too (rounded to us).
  EXPECT_TRUE(has_text(ts, with_thousands(std::lround(c.bars[0].second.class_us[int(KernelClass::kAttention)]))));
  EXPECT_TRUE(has_text(ts, "Combine"));
  EXPECT_FALSE(has_text(ts, "AllReduce"));  // TP1: no all-reduce row
  expect_inside_canvas(c.breakdown, "breakdown");
  expect_plain_numbers(c.breakdown, "breakdown");
}

// Issue 8: the roofline's legend ran off the right edge and its points had no labels.
TEST(PlanCharts, RooflineLegendInsideAndPointsLabelled) {
  const Charts c = charts();
  const auto ts = texts(c.roofline);
  EXPECT_TRUE(has_text(ts, "fp8 roof 1,979 TFLOP/s, 3.35 TB/s"));
  EXPECT_TRUE(has_text(ts, "bf16 roof 989 TFLOP/s"));
  // Each kernel's name is on the chart (kernels on one spot share a label "a, b").
  for (const auto& k : c.kernels) {
    if (k.flops <= 0) continue;
    const bool named = std::any_of(ts.begin(), ts.end(), [&](const Text& t) {
      return t.s == k.name || t.s.rfind(k.name + ", ", 0) == 0 || t.s.find(", " + k.name) != std::string::npos;
    });
    EXPECT_TRUE(named) << k.name;
  }
  expect_inside_canvas(c.roofline, "roofline");
  expect_plain_numbers(c.roofline, "roofline");
  // A GQA model whose kernels pile up in two spots: still every name, once.
  PlanInput q = input("qwen3-235b-a22b", "h200", "nvlink", {8, 4, 2, 8}, 64);
  const auto qk = simulate_step(q).moe_layer.kernels;
  const std::string qsvg = svg_roofline(q.gpu, {{"EP8 DP4 TP2 b64", qk}}, "Qwen");
  std::string all;
  for (const auto& t : texts(qsvg)) all += t.s + "|";
  for (const auto& k : qk) {
    if (k.flops <= 0) continue;
    const size_t at = all.find(k.name);
    EXPECT_NE(at, std::string::npos) << k.name << " in " << all;
    if (at != std::string::npos) {
      EXPECT_EQ(all.find(k.name, at + 1), std::string::npos) << k.name << " twice";
    }
  }
  expect_inside_canvas(qsvg, "qwen roofline");
  // A label too long for the default width widens the canvas instead of being cut.
  Series s;
  s.label = std::string(120, 'x');
  s.x = {1, 2};
  s.y = {1, 2};
  const std::string wide = svg_chart({"t", "x", "y", false, false}, {s});
  EXPECT_GT(canvas(wide).first, 760);
  expect_inside_canvas(wide, "wide legend");
}

// Issue 8: the Pareto chart mixed "1e+04" and "1000".
TEST(PlanCharts, ParetoOneTickStyle) {
  const Charts c = charts();
  const auto ts = texts(c.pareto);
  EXPECT_TRUE(has_text(ts, "1,000"));
  EXPECT_TRUE(has_text(ts, "10,000"));
  EXPECT_TRUE(has_text(ts, "EP128 (H100-SXM)"));
  EXPECT_TRUE(has_text(ts, "EP8 (H200-SXM)"));
  EXPECT_NE(c.pareto.find("stroke-dasharray"), std::string::npos);  // the second GPU's frontiers are dashed
  expect_inside_canvas(c.pareto, "pareto");
  expect_plain_numbers(c.pareto, "pareto");
}

// Each chart renders to a PNG (rsvg-convert, Debian package librsvg2-bin) of the
// SVG's size with real content in it.
TEST(PlanCharts, RenderToPng) {
  if (std::system("command -v rsvg-convert >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "rsvg-convert not found (apt-get install -y librsvg2-bin); PNG rendering not checked";
  const Charts c = charts();
  const auto dir = scratch_dir("png");
  for (const auto& [name, svg] : {std::pair{"breakdown", c.breakdown}, {"roofline", c.roofline}, {"pareto", c.pareto}}) {
    const auto svg_path = dir / (std::string(name) + ".svg"), png_path = dir / (std::string(name) + ".png");
    std::ofstream(svg_path) << svg;
    const std::string cmd = "rsvg-convert '" + svg_path.string() + "' -o '" + png_path.string() + "' 2>&1";
    CliRun r = run_command(cmd);
    ASSERT_EQ(r.rc, 0) << name << ": " << r.out;
    std::ifstream f(png_path, std::ios::binary);
    const std::string png((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_GE(png.size(), 24u) << name;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << name;
    // IHDR: width and height, big-endian, at bytes 16..23: the SVG's canvas.
    auto be32 = [&](size_t at) {
      return (uint32_t(uint8_t(png[at])) << 24) | (uint32_t(uint8_t(png[at + 1])) << 16) |
             (uint32_t(uint8_t(png[at + 2])) << 8) | uint32_t(uint8_t(png[at + 3]));
    };
    const auto [w, h] = canvas(svg);
    EXPECT_EQ(be32(16), uint32_t(w)) << name;
    EXPECT_EQ(be32(20), uint32_t(h)) << name;
    // A blank canvas of this size compresses to ~1-2 KB; text, axes and data take far more.
    EXPECT_GT(png.size(), 15000u) << name << ": the PNG looks empty";
  }
  std::filesystem::remove_all(dir);
}
