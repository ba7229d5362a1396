// moelink-plan: SVG charts written without dependencies.
#pragma once
#include <string>
#include <vector>

#include "moelink/plan/step.h"
#include "moelink/plan/sweep.h"

namespace moelink::plan {

struct Series {
  std::string label;
  std::vector<double> x, y;
  bool line = true;
  bool markers = true;                    // a dot at each point
  int color = -1;                         // palette index; -1: the series' position
  std::string dash;                       // stroke-dasharray of the line ("" = solid)
  std::vector<std::string> point_labels;  // optional text beside each point (placed to avoid overlaps)
};

struct ChartSpec {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
  int width = 760, height = 480;
};

// Generic scatter/line chart: axes with tick labels (plain numbers, thousands
// separators), legend right of the plot; the canvas widens to keep it inside.
std::string svg_chart(const ChartSpec& spec, const std::vector<Series>& series);
// Throughput per node vs output speed, one frontier per (GPU, EP size).
std::string svg_pareto(const std::vector<SweepPoint>& pts, const std::string& title);
// Roofline of the GPU with the kernels of the given layers placed on it, each labelled.
std::string svg_roofline(const GpuProfile& gpu, const std::vector<std::pair<std::string, std::vector<Kernel>>>& sets,
                         const std::string& title);
// Stacked bars of per-class layer time, one bar per labelled layer timing, on a
// time axis (us) with values on the segments and a value table as legend.
std::string svg_breakdown(const std::vector<std::pair<std::string, LayerTiming>>& bars,
                          const std::string& title);
std::string xml_escape(const std::string& s);

}  // namespace moelink::plan
