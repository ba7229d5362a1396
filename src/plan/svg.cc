#include "moelink/plan/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace moelink::plan {
namespace {
const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                         "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}
std::string tick_label(double v) {
  char b[32];
  if (std::fabs(v) >= 1e4 || (std::fabs(v) < 0.01 && v != 0)) std::snprintf(b, sizeof b, "%.0e", v);
  else std::snprintf(b, sizeof b, "%g", v);
  return b;
}

struct Axis {
  double lo, hi;
  bool log;
  double px0, px1;
  double map(double v) const {
    const double a = log ? std::log10(std::max(v, 1e-300)) : v;
    const double l = log ? std::log10(lo) : lo, h = log ? std::log10(hi) : hi;
    return px0 + (a - l) / (h - l) * (px1 - px0);
  }
  std::vector<double> ticks() const {
    std::vector<double> t;
    if (log) {
      for (double e = std::floor(std::log10(lo)); e <= std::ceil(std::log10(hi)); ++e) {
        const double v = std::pow(10.0, e);
        if (v >= lo * 0.999 && v <= hi * 1.001) t.push_back(v);
      }
    } else {
      const double raw = (hi - lo) / 6, mag = std::pow(10.0, std::floor(std::log10(raw)));
      const double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
      for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9; v += step) t.push_back(v);
    }
    return t;
  }
};

Axis make_axis(std::vector<double> vals, bool log, double px0, double px1) {
  double lo = std::numeric_limits<double>::max(), hi = std::numeric_limits<double>::lowest();
  for (double v : vals) {
    if (log && v <= 0) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (lo > hi) lo = 1, hi = 10;
  if (log) {
    lo = std::pow(10.0, std::floor(std::log10(lo)));
    hi = std::pow(10.0, std::ceil(std::log10(hi)));
    if (lo == hi) hi = lo * 10;
  } else {
    if (lo > 0) lo = 0;
    if (hi == lo) hi = lo + 1;
    hi *= 1.05;
  }
  return {lo, hi, log, px0, px1};
}

std::string header(int w, int h, const std::string& title) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
         std::to_string(w) + "\" height=\"" + std::to_string(h) + "\" viewBox=\"0 0 " + std::to_string(w) + " " +
         std::to_string(h) + "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n" +
         "<text x=\"" + std::to_string(w / 2) + "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">" +
         xml_escape(title) + "</text>\n";
}

std::string frame(const ChartSpec& s, const Axis& x, const Axis& y) {
  std::string o;
  o += "<rect x=\"" + num(x.px0) + "\" y=\"" + num(y.px1) + "\" width=\"" + num(x.px1 - x.px0) + "\" height=\"" +
       num(y.px0 - y.px1) + "\" fill=\"none\" stroke=\"#333\"/>\n";
  for (double t : x.ticks()) {
    const double p = x.map(t);
    o += "<line x1=\"" + num(p) + "\" y1=\"" + num(y.px0) + "\" x2=\"" + num(p) + "\" y2=\"" + num(y.px1) +
         "\" stroke=\"#ddd\"/>\n<text x=\"" + num(p) + "\" y=\"" + num(y.px0 + 16) + "\" text-anchor=\"middle\">" +
         tick_label(t) + "</text>\n";
  }
  for (double t : y.ticks()) {
    const double p = y.map(t);
    o += "<line x1=\"" + num(x.px0) + "\" y1=\"" + num(p) + "\" x2=\"" + num(x.px1) + "\" y2=\"" + num(p) +
         "\" stroke=\"#ddd\"/>\n<text x=\"" + num(x.px0 - 6) + "\" y=\"" + num(p + 4) + "\" text-anchor=\"end\">" +
         tick_label(t) + "</text>\n";
  }
  o += "<text x=\"" + num((x.px0 + x.px1) / 2) + "\" y=\"" + num(y.px0 + 38) + "\" text-anchor=\"middle\">" +
       xml_escape(s.x_label) + "</text>\n";
  o += "<text transform=\"translate(18," + num((y.px0 + y.px1) / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
       xml_escape(s.y_label) + "</text>\n";
  return o;
}
}  // namespace

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string svg_chart(const ChartSpec& spec, const std::vector<Series>& series) {
  std::vector<double> xs, ys;
  for (const auto& s : series) {
    xs.insert(xs.end(), s.x.begin(), s.x.end());
    ys.insert(ys.end(), s.y.begin(), s.y.end());
  }
  const double left = 80, right = spec.width - 170, top = 40, bottom = spec.height - 55;
  Axis x = make_axis(xs, spec.log_x, left, right);
  Axis y = make_axis(ys, spec.log_y, bottom, top);
  std::string o = header(spec.width, spec.height, spec.title) + frame(spec, x, y);
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* col = kColors[i % 10];
    std::string pts;
    for (size_t k = 0; k < s.x.size() && k < s.y.size(); ++k) {
      if ((spec.log_x && s.x[k] <= 0) || (spec.log_y && s.y[k] <= 0)) continue;
      pts += num(x.map(s.x[k])) + "," + num(y.map(s.y[k])) + " ";
      o += "<circle cx=\"" + num(x.map(s.x[k])) + "\" cy=\"" + num(y.map(s.y[k])) + "\" r=\"3\" fill=\"" + col + "\"/>\n";
    }
    if (s.line && !pts.empty())
      o += "<polyline points=\"" + pts + "\" fill=\"none\" stroke=\"" + col + "\" stroke-width=\"2\"/>\n";
    const double ly = top + 10 + 18.0 * i;
    o += "<rect x=\"" + num(right + 12) + "\" y=\"" + num(ly - 9) + "\" width=\"12\" height=\"12\" fill=\"" + col +
         "\"/>\n<text x=\"" + num(right + 30) + "\" y=\"" + num(ly + 1) + "\">" + xml_escape(s.label) + "</text>\n";
  }
  return o + "</svg>\n";
}

std::string svg_pareto(const std::vector<SweepPoint>& pts, const std::string& title) {
  std::vector<Series> series;
  for (const auto& [ep, f] : frontiers_by_ep(pts)) {
    Series s;
    s.label = "EP" + std::to_string(ep) + (f.empty() ? "" : " (" + f.front().gpu + ")");
    for (const auto& p : f) {
      s.x.push_back(p.output_tok_s);
      s.y.push_back(p.throughput_node);
    }
    series.push_back(s);
  }
  ChartSpec spec{title, "output speed per request (tokens/s)", "throughput per node (tokens/s)", false, true};
  return svg_chart(spec, series);
}

std::string svg_roofline(const GpuProfile& gpu,
                         const std::vector<std::pair<std::string, std::vector<Kernel>>>& sets,
                         const std::string& title) {
  std::vector<Series> series;
  // Roofs: HBM slope and the fp8 / bf16 peaks (TFLOP/s vs FLOP/byte).
  Series roof8, roof16;
  roof8.label = "fp8 roof " + tick_label(gpu.fp8_tflops) + " TF/s, " + tick_label(gpu.hbm_gbps / 1000) + " TB/s";
  roof16.label = "bf16 roof " + tick_label(gpu.bf16_tflops) + " TF/s";
  for (double i = 1; i <= 1e5; i *= 1.25) {
    roof8.x.push_back(i);
    roof8.y.push_back(std::min(gpu.fp8_tflops, i * gpu.hbm_gbps / 1000));
    roof16.x.push_back(i);
    roof16.y.push_back(std::min(gpu.bf16_tflops, i * gpu.hbm_gbps / 1000));
  }
  series.push_back(roof8);
  series.push_back(roof16);
  for (const auto& [label, ks] : sets) {
    Series s;
    s.label = label;
    s.line = false;
    for (const auto& k : ks) {
      if (k.flops <= 0 || k.bytes <= 0 || k.time_us <= 0) continue;
      s.x.push_back(k.intensity());
      s.y.push_back(k.flops / (k.time_us * 1e-6) / 1e12);
    }
    series.push_back(s);
  }
  ChartSpec spec{title, "arithmetic intensity (FLOP/byte)", "achieved (modelled) TFLOP/s", true, true};
  return svg_chart(spec, series);
}

std::string svg_breakdown(const std::vector<std::pair<std::string, LayerTiming>>& bars, const std::string& title) {
  const int w = 760, h = 120 + 46 * int(bars.size()) + 60;
  std::string o = header(w, h, title);
  double maxt = 1;
  for (const auto& b : bars) maxt = std::max(maxt, b.second.total_us);
  const double left = 190, right = w - 30, top = 50;
  for (size_t i = 0; i < bars.size(); ++i) {
    const double y = top + 46.0 * i;
    double x = left;
    o += "<text x=\"" + num(left - 8) + "\" y=\"" + num(y + 19) + "\" text-anchor=\"end\">" +
         xml_escape(bars[i].first) + "</text>\n";
    for (int c = 0; c < kNumKernelClasses; ++c) {
      const double wpx = bars[i].second.class_us[c] / maxt * (right - left - 60);
      if (wpx <= 0) continue;
      o += "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(wpx) + "\" height=\"28\" fill=\"" +
           kColors[c % 10] + "\"><title>" + to_string(KernelClass(c)) + " " + num(bars[i].second.class_us[c]) +
           " us</title></rect>\n";
      x += wpx;
    }
    o += "<text x=\"" + num(x + 6) + "\" y=\"" + num(y + 19) + "\">" + num(bars[i].second.total_us) + " us</text>\n";
  }
  const double ly = top + 46.0 * bars.size() + 10;
  for (int c = 0; c < kNumKernelClasses; ++c) {
    const double lx = 20 + 145.0 * (c % 5), yy = ly + 20.0 * (c / 5);
    o += "<rect x=\"" + num(lx) + "\" y=\"" + num(yy) + "\" width=\"12\" height=\"12\" fill=\"" + kColors[c % 10] +
         "\"/>\n<text x=\"" + num(lx + 16) + "\" y=\"" + num(yy + 10) + "\">" + to_string(KernelClass(c)) + "</text>\n";
  }
  return o + "</svg>\n";
}

}  // namespace moelink::plan
