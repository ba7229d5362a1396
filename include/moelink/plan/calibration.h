// moelink-plan: measured dispatch/combine latencies from moelink-bench JSON.
#pragma once
#include <string>
#include <vector>

namespace moelink::plan {

struct BenchSample {
  double tokens = 0;
  double dispatch_us = 0;  // p50
  double combine_us = 0;   // p50
};

class Calibration {
 public:
  static Calibration from_json_text(const std::string& text, const std::string& source);
  static Calibration from_file(const std::string& path);
  // Used only for layouts with EP == world_size and the same hidden size.
  bool applies(int ep, long hidden) const { return ep == world_size && hidden == hidden_dim; }
  // Log-log interpolation in tokens per rank; clamped/extrapolated linearly in
  // tokens beyond the measured range.
  double dispatch_us(double tokens) const { return interp(tokens, true); }
  double combine_us(double tokens) const { return interp(tokens, false); }

  std::string source, machine, date;
  int world_size = 0;
  long hidden_dim = 0;
  int experts = 0, topk = 0;
  std::vector<BenchSample> samples;  // sorted by tokens

 private:
  double interp(double tokens, bool dispatch) const;
};

}  // namespace moelink::plan
