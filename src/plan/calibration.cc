#include "moelink/plan/calibration.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "moelink/plan/model.h"
#include "moelink/plan/profiles.h"

namespace moelink::plan {

Calibration Calibration::from_json_text(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw PlanError("bench results '" + source + "': not valid JSON: " + e.what());
  }
  Calibration c;
  c.source = source;
  c.machine = j.value("machine", std::string());
  c.date = j.value("date", std::string());
  c.world_size = j.value("world_size", 0);
  if (j.contains("config")) {
    const auto& cfg = j["config"];
    c.hidden_dim = cfg.value("hidden_dim", 0L);
    c.experts = cfg.value("num_experts", 0);
    c.topk = cfg.value("experts_per_token", 0);
  }
  if (!j.contains("results") || !j["results"].is_array())
    throw PlanError("bench results '" + source + "': no \"results\" array (is it moelink-bench --json output?)");
  for (const auto& r : j["results"]) {
    if (!r.contains("quantities")) continue;
    const auto& q = r["quantities"];
    if (!q.contains("dispatch") || !q.contains("combine")) continue;
    BenchSample s;
    s.tokens = r.value("tokens", 0.0);
    s.dispatch_us = q["dispatch"].value("p50_us", 0.0);
    s.combine_us = q["combine"].value("p50_us", 0.0);
    if (s.tokens > 0 && s.dispatch_us > 0 && s.combine_us > 0) c.samples.push_back(s);
  }
  if (c.samples.empty())
    throw PlanError("bench results '" + source + "': no result with dispatch and combine p50_us");
  if (c.world_size <= 0) throw PlanError("bench results '" + source + "': no world_size");
  std::sort(c.samples.begin(), c.samples.end(),
            [](const BenchSample& a, const BenchSample& b) { return a.tokens < b.tokens; });
  return c;
}

Calibration Calibration::from_file(const std::string& path) { return from_json_text(read_text_file(path), path); }

double Calibration::interp(double tokens, bool dispatch) const {
  auto val = [&](const BenchSample& s) { return dispatch ? s.dispatch_us : s.combine_us; };
  const auto& v = samples;
  if (v.size() == 1 || tokens <= v.front().tokens) return val(v.front());
  if (tokens >= v.back().tokens) {
    if (v.size() < 2) return val(v.back());
    // Beyond the range: the per-token cost of the last segment, linearly.
    const auto& a = v[v.size() - 2];
    const auto& b = v.back();
    const double slope = (val(b) - val(a)) / (b.tokens - a.tokens);
    return val(b) + std::max(0.0, slope) * (tokens - b.tokens);
  }
  for (size_t i = 1; i < v.size(); ++i) {
    if (tokens <= v[i].tokens) {
      const auto& a = v[i - 1];
      const auto& b = v[i];
      const double f = std::log(tokens / a.tokens) / std::log(b.tokens / a.tokens);
      return std::exp(std::log(val(a)) + f * (std::log(val(b)) - std::log(val(a))));
    }
  }
  return val(v.back());
}

}  // namespace moelink::plan
