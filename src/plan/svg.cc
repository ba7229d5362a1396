#include "moelink/plan/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "moelink/plan/options.h"

namespace moelink::plan {
namespace {
const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                         "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
constexpr double kFont = 12, kSmallFont = 10;

// Text colour readable on a fill "#rrggbb": black on light fills, else white.
const char* ink_on(const char* fill) {
  unsigned r = 0, g = 0, b = 0;
  std::sscanf(fill, "#%2x%2x%2x", &r, &g, &b);
  return 0.299 * r + 0.587 * g + 0.114 * b > 150 ? "black" : "white";
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}
// One style on every axis: plain numbers, integers with thousands separators
// (100, 1,000, 10,000), fractions as decimals (0.1, 2.5); never "1e+04".
std::string tick_label(double v) {
  if (v == 0) return "0";
  if (std::fabs(v) >= 1 && std::fabs(v - std::round(v)) < 1e-9 * std::fabs(v)) return with_thousands(std::llround(v));
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
// Width of a text in pixels, estimated: SVG has no text metrics, and the
// renderer's sans-serif (DejaVu Sans under rsvg) averages under 0.62 em.
double text_width(const std::string& s, double font) { return 0.62 * font * double(s.size()); }

std::string text(double x, double y, const std::string& s, const char* anchor = "start", double font = kFont,
                 const std::string& extra = "") {
  std::string o = "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\"";
  if (std::string(anchor) != "start") o += std::string(" text-anchor=\"") + anchor + "\"";
  if (font != kFont) o += " font-size=\"" + num(font) + "\"";
  return o + extra + ">" + xml_escape(s) + "</text>\n";
}
std::string line(double x1, double y1, double x2, double y2, const char* stroke) {
  return "<line x1=\"" + num(x1) + "\" y1=\"" + num(y1) + "\" x2=\"" + num(x2) + "\" y2=\"" + num(y2) +
         "\" stroke=\"" + stroke + "\"/>\n";
}
std::string rect(double x, double y, double w, double h, const std::string& fill) {
  return "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) + "\" height=\"" + num(h) +
         "\" fill=\"" + fill + "\"/>\n";
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
      // Decades; over two decades or less also 2x and 5x, so a short axis
      // still has enough labelled ticks to be read.
      const bool fine = std::log10(hi / lo) <= 2.01;
      for (double e = std::floor(std::log10(lo)); e <= std::ceil(std::log10(hi)); ++e) {
        for (double m : {1.0, 2.0, 5.0}) {
          if (m > 1 && !fine) continue;
          const double v = m * std::pow(10.0, e);
          if (v >= lo * 0.999 && v <= hi * 1.001) t.push_back(v);
        }
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
    o += line(p, y.px0, p, y.px1, "#ddd") + text(p, y.px0 + 16, tick_label(t), "middle");
  }
  for (double t : y.ticks()) {
    const double p = y.map(t);
    o += line(x.px0, p, x.px1, p, "#ddd") + text(x.px0 - 6, p + 4, tick_label(t), "end");
  }
  o += text((x.px0 + x.px1) / 2, y.px0 + 38, s.x_label, "middle");
  o += "<text transform=\"translate(18," + num((y.px0 + y.px1) / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
       xml_escape(s.y_label) + "</text>\n";
  return o;
}

// Greedy placement of point labels: each label takes the first of a ring of
// spots around its point that stays inside the plot and overlaps no marker and
// no earlier label; a label away from its point gets a leader line.
struct Box {
  double x0, y0, x1, y1;
  bool overlaps(const Box& b) const { return x0 < b.x1 && b.x0 < x1 && y0 < b.y1 && b.y0 < y1; }
};
class LabelPlacer {
 public:
  explicit LabelPlacer(Box area) : area_(area) {}
  void block(double px, double py, double r = 3) { placed_.push_back({px - r, py - r, px + r, py + r}); }
  // A drawn line, as small boxes every 3 px, so that no label is written over it.
  void block_segment(double x0, double y0, double x1, double y1) {
    const int n = std::max(1, int(std::hypot(x1 - x0, y1 - y0) / 3));
    for (int i = 0; i <= n; ++i) block(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n, 1.5);
  }
  std::string place(double px, double py, const std::string& label) {
    const double w = text_width(label, kSmallFont), h = kSmallFont + 2;
    struct Spot {
      double dx, dy;
      const char* anchor;
    };
    // Beside the point first, then above/below, then further out (with a leader).
    static const Spot spots[] = {{6, 4, "start"},    {-6, 4, "end"},     {0, -7, "middle"},  {0, 15, "middle"},
                                 {6, -8, "start"},   {6, 16, "start"},   {-6, -8, "end"},    {-6, 16, "end"},
                                 {14, -20, "start"}, {14, 28, "start"},  {-14, -20, "end"},  {-14, 28, "end"},
                                 {0, -22, "middle"}, {0, 30, "middle"},  {24, -34, "start"}, {24, 42, "start"},
                                 {-24, -34, "end"},  {-24, 42, "end"},   {40, 4, "start"},   {-40, 4, "end"}};
    constexpr int kNear = 8;  // spots[0..kNear) touch their point
    int chosen = -1;
    Box chosen_box{};
    for (int i = 0; i < int(std::size(spots)); ++i) {
      const Spot& s = spots[i];
      const double x = px + s.dx, base = py + s.dy;
      const double x0 = std::string(s.anchor) == "start" ? x : std::string(s.anchor) == "end" ? x - w : x - w / 2;
      const Box b{x0, base - h + 2, x0 + w, base + 2};
      if (b.x0 < area_.x0 || b.x1 > area_.x1 || b.y0 < area_.y0 || b.y1 > area_.y1) continue;
      const bool free = std::none_of(placed_.begin(), placed_.end(), [&](const Box& p) { return p.overlaps(b); });
      if (free || chosen < 0) chosen = i, chosen_box = b;  // crowded everywhere: the first spot inside
      if (free) break;
    }
    if (chosen < 0) return "";
    placed_.push_back(chosen_box);
    const Spot& s = spots[chosen];
    std::string o;
    if (chosen >= kNear) {
      const double lx = std::clamp(px, chosen_box.x0, chosen_box.x1);
      const double ly = py < chosen_box.y0 ? chosen_box.y0 : chosen_box.y1;
      o += "<line x1=\"" + num(px) + "\" y1=\"" + num(py) + "\" x2=\"" + num(lx) + "\" y2=\"" + num(ly) +
           "\" stroke=\"#999\" stroke-width=\"0.8\"/>\n";
    }
    return o + text(px + s.dx, py + s.dy, label, s.anchor, kSmallFont, " fill=\"#333\"");
  }

 private:
  Box area_;
  std::vector<Box> placed_;
};

// Legend to the right of the plot, sized from its longest label.
double legend_width(const std::vector<Series>& series) {
  double w = 0;
  for (const auto& s : series) w = std::max(w, text_width(s.label, kFont));
  return series.empty() ? 0 : 12 + 6 + w + 8;
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
  // The legend sits right of the plot, inside the canvas: the canvas widens
  // rather than squeezing the plot below 400 px.
  const double left = 80, top = 40, legend_w = legend_width(series);
  const int width = std::max(spec.width, int(std::ceil(left + 400 + 16 + legend_w + 10)));
  const double right = width - 10 - legend_w - 16, bottom = spec.height - 55;
  Axis x = make_axis(xs, spec.log_x, left, right);
  Axis y = make_axis(ys, spec.log_y, bottom, top);
  auto visible = [&](const Series& s, size_t k) { return !(spec.log_x && s.x[k] <= 0) && !(spec.log_y && s.y[k] <= 0); };
  std::string o = header(width, spec.height, spec.title) + frame(spec, x, y);
  LabelPlacer labels(Box{left + 2, top + 2, right - 2, bottom - 2});
  for (const auto& s : series) {
    std::vector<std::pair<double, double>> drawn;
    for (size_t k = 0; k < s.x.size() && k < s.y.size(); ++k)
      if (visible(s, k)) drawn.push_back({x.map(s.x[k]), y.map(s.y[k])});
    for (size_t k = 0; k < drawn.size(); ++k) {
      if (s.markers) labels.block(drawn[k].first, drawn[k].second);
      if (s.line && k > 0) labels.block_segment(drawn[k - 1].first, drawn[k - 1].second, drawn[k].first, drawn[k].second);
    }
  }
  const bool line_swatches = std::any_of(series.begin(), series.end(), [](const Series& s) { return !s.dash.empty(); });
  // Point labels, gathered while drawing and placed last (over the lines);
  // points drawn on top of each other (within 3 px) share one label "a, b".
  struct PointLabel {
    double x, y;
    std::string text;
  };
  std::vector<PointLabel> point_labels;
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* col = kColors[(s.color >= 0 ? size_t(s.color) : i) % 10];
    const std::string dash = s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"";
    std::string pts;
    for (size_t k = 0; k < s.x.size() && k < s.y.size(); ++k) {
      if (!visible(s, k)) continue;
      const double px = x.map(s.x[k]), py = y.map(s.y[k]);
      pts += num(px) + "," + num(py) + " ";
      if (s.markers)
        o += "<circle cx=\"" + num(px) + "\" cy=\"" + num(py) + "\" r=\"3\" fill=\"" + col + "\"/>\n";
      if (k < s.point_labels.size() && !s.point_labels[k].empty()) {
        auto same = std::find_if(point_labels.begin(), point_labels.end(),
                                 [&](const PointLabel& p) { return std::hypot(p.x - px, p.y - py) < 3; });
        if (same != point_labels.end()) same->text += ", " + s.point_labels[k];
        else point_labels.push_back({px, py, s.point_labels[k]});
      }
    }
    if (s.line && !pts.empty())
      o += "<polyline points=\"" + pts + "\" fill=\"none\" stroke=\"" + col + "\" stroke-width=\"2\"" + dash + "/>\n";
    // Legend: a swatch (a line sample when dashes tell series apart) and the label.
    const double ly = top + 10 + 18.0 * i;
    if (!line_swatches || !s.line) o += rect(right + 16, ly - 9, 12, 12, col);
    else o += "<line x1=\"" + num(right + 14) + "\" y1=\"" + num(ly - 3) + "\" x2=\"" + num(right + 30) + "\" y2=\"" +
              num(ly - 3) + "\" stroke=\"" + col + "\" stroke-width=\"2.5\"" + dash + "/>\n";
    o += text(right + 34, ly + 1, s.label);
  }
  for (const auto& p : point_labels) o += labels.place(p.x, p.y, p.text);
  return o + "</svg>\n";
}

std::string svg_pareto(const std::vector<SweepPoint>& pts, const std::string& title) {
  // Several GPU types: one colour per EP size and one dash pattern per GPU, so
  // the same EP on two GPUs reads as a pair.
  const auto fronts = frontiers_by_gpu_and_ep(pts);
  std::vector<std::string> gpus;
  std::vector<int> eps;
  for (const auto& [key, f] : fronts) {
    if (std::find(gpus.begin(), gpus.end(), key.first) == gpus.end()) gpus.push_back(key.first);
    if (std::find(eps.begin(), eps.end(), key.second) == eps.end()) eps.push_back(key.second);
  }
  std::sort(eps.begin(), eps.end());
  static const char* kDashes[] = {"", "7,4", "2,3", "9,3,2,3"};
  std::vector<Series> series;
  for (const auto& [key, f] : fronts) {
    Series s;
    s.label = "EP" + std::to_string(key.second) + (key.first.empty() ? "" : " (" + key.first + ")");
    if (gpus.size() > 1) {
      s.color = int(std::find(eps.begin(), eps.end(), key.second) - eps.begin());
      s.dash = kDashes[(std::find(gpus.begin(), gpus.end(), key.first) - gpus.begin()) % 4];
    }
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
  for (const auto& [label, ks] : sets) {
    Series s;
    s.label = label;
    s.line = false;
    for (const auto& k : ks) {
      if (k.flops <= 0 || k.bytes <= 0 || k.time_us <= 0) continue;
      s.x.push_back(k.intensity());
      s.y.push_back(k.flops / (k.time_us * 1e-6) / 1e12);
      s.point_labels.push_back(k.name);
    }
    series.push_back(s);
  }
  // Roofs (TFLOP/s vs FLOP/byte): the HBM slope up to the fp8 / bf16 peaks,
  // drawn from a bit left of the kernels to a bit right of the fp8 ridge.
  double lo = 1, hi = gpu.fp8_tflops * 1000 / gpu.hbm_gbps;
  for (const auto& s : series)
    for (double v : s.x) lo = std::min(lo, v), hi = std::max(hi, v);
  lo /= 2, hi *= 4;
  auto roof = [&](const std::string& label, double peak) {
    Series r;
    r.label = label;
    r.markers = false;
    const double ridge = peak * 1000 / gpu.hbm_gbps;
    for (double i : {lo, std::clamp(ridge, lo, hi), hi}) {
      r.x.push_back(i);
      r.y.push_back(std::min(peak, i * gpu.hbm_gbps / 1000));
    }
    return r;
  };
  series.insert(series.begin(), roof("bf16 roof " + tick_label(gpu.bf16_tflops) + " TFLOP/s", gpu.bf16_tflops));
  series.insert(series.begin(), roof("fp8 roof " + tick_label(gpu.fp8_tflops) + " TFLOP/s, " +
                                         tick_label(gpu.hbm_gbps / 1000) + " TB/s",
                                     gpu.fp8_tflops));
  // Wider than the default: the kernels crowd around the ridge, their labels need room.
  ChartSpec spec{title, "arithmetic intensity (FLOP/byte)", "achieved (modelled) TFLOP/s", true, true, 960, 560};
  return svg_chart(spec, series);
}

std::string svg_breakdown(const std::vector<std::pair<std::string, LayerTiming>>& bars, const std::string& title) {
  // Which classes any bar has: the value table lists only those.
  std::vector<int> classes;
  for (int c = 0; c < kNumKernelClasses; ++c)
    if (std::any_of(bars.begin(), bars.end(), [&](const auto& b) { return b.second.class_us[c] > 0; }))
      classes.push_back(c);
  // Table columns: one per bar, headed by its label broken at spaces into
  // lines of at most 16 characters, so long layout names stay narrow.
  std::vector<std::vector<std::string>> heads;
  size_t head_lines = 1;
  double col_w = text_width("0000.0", kFont);
  for (const auto& b : bars) {
    std::vector<std::string> lines{""};
    for (size_t i = 0, j; i <= b.first.size(); i = j + 1) {
      j = std::min(b.first.find(' ', i), b.first.size());
      const std::string word = b.first.substr(i, j - i);
      if (!lines.back().empty() && lines.back().size() + 1 + word.size() > 16) lines.push_back("");
      lines.back() += (lines.back().empty() ? "" : " ") + word;
    }
    for (const auto& l : lines) col_w = std::max(col_w, text_width(l, kFont));
    head_lines = std::max(head_lines, lines.size());
    heads.push_back(lines);
  }
  col_w += 16;
  double label_w = 0;
  for (const auto& b : bars) label_w = std::max(label_w, text_width(b.first, kFont));
  const double name_w = 12 + 6 + text_width("Norm/Elementwise", kFont) + 12;
  const double table_w = name_w + col_w * double(bars.size());
  const int w = int(std::ceil(std::max({760.0, label_w + 20 + 400 + 80, 20 + table_w + 20})));
  const double left = label_w + 20, right = w - 80, top = 50, bar_h = 28, pitch = 46;
  const double axis_y = top + pitch * double(bars.size()) - (pitch - bar_h) + 6;
  const double table_y = axis_y + 62;
  const int h = int(std::ceil(table_y + 15.0 * double(head_lines) + 18.0 * double(classes.size() + 1) + 20));

  double maxt = 1;
  for (const auto& b : bars) maxt = std::max(maxt, b.second.total_us);
  const Axis x = make_axis({0, maxt}, false, left, right);
  std::string o = header(w, h, title);
  // Time axis under the bars: grid lines, ticks and labels in us.
  for (double t : x.ticks()) {
    const double p = x.map(t);
    o += line(p, top - 4, p, axis_y, "#ddd") + line(p, axis_y, p, axis_y + 5, "#333") +
         text(p, axis_y + 18, tick_label(t), "middle");
  }
  o += line(left, axis_y, right, axis_y, "#333");
  o += text((left + right) / 2, axis_y + 36, "time per MoE layer per GPU (us; dispatch/combine as exposed)", "middle");
  for (size_t i = 0; i < bars.size(); ++i) {
    const double y = top + pitch * double(i);
    const LayerTiming& t = bars[i].second;
    o += text(left - 8, y + 19, bars[i].first, "end");
    double xs = left;
    for (int c = 0; c < kNumKernelClasses; ++c) {
      const double wpx = x.map(t.class_us[c]) - left;
      if (wpx <= 0) continue;
      o += "<rect x=\"" + num(xs) + "\" y=\"" + num(y) + "\" width=\"" + num(wpx) + "\" height=\"" + num(bar_h) +
           "\" fill=\"" + kColors[c % 10] + "\"><title>" + to_string(KernelClass(c)) + " " + num(t.class_us[c]) +
           " us</title></rect>\n";
      // The value printed on the segment where it fits (all are in the table).
      const std::string v = with_thousands(std::lround(t.class_us[c]));
      if (text_width(v, kSmallFont) + 4 <= wpx)
        o += text(xs + wpx / 2, y + 18, v, "middle", kSmallFont, std::string(" fill=\"") + ink_on(kColors[c % 10]) + "\"");
      xs += wpx;
    }
    o += text(xs + 6, y + 19, num(t.total_us) + " us");
  }
  // Value table, which is also the legend: one row per class, one column per bar.
  const double tx = 20;
  o += text(tx, table_y - 8, "us per MoE layer", "start", kFont, " font-weight=\"bold\"");
  for (size_t b = 0; b < heads.size(); ++b)
    for (size_t l = 0; l < heads[b].size(); ++l)
      o += text(tx + name_w + col_w * double(b + 1) - 8, table_y + 10 + 15.0 * double(head_lines - heads[b].size() + l), heads[b][l], "end",
                kFont, " font-weight=\"bold\"");
  const double rows_y = table_y + 15.0 * double(head_lines) + 4;
  o += line(tx, rows_y, tx + table_w, rows_y, "#333");
  for (size_t r = 0; r <= classes.size(); ++r) {
    const double ry = rows_y + 18.0 * double(r) + 14;
    const bool total = r == classes.size();
    if (total) {
      o += line(tx, ry - 13, tx + table_w, ry - 13, "#333");
      o += text(tx + 18, ry, "total", "start", kFont, " font-weight=\"bold\"");
    } else {
      o += rect(tx, ry - 10, 12, 12, kColors[classes[r] % 10]) + text(tx + 18, ry, to_string(KernelClass(classes[r])));
    }
    for (size_t b = 0; b < bars.size(); ++b) {
      const double v = total ? bars[b].second.total_us : bars[b].second.class_us[classes[r]];
      o += text(tx + name_w + col_w * double(b + 1) - 8, ry, num(v), "end", kFont, total ? " font-weight=\"bold\"" : "");
    }
  }
  return o + "</svg>\n";
}

}  // namespace moelink::plan
