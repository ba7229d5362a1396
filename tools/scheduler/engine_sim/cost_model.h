// The engine simulator's time model, from moelink-plan's roofline model of a
// deployment (one simulated engine = one DP group of that deployment):
// the time of one decode step by batch size and context length, and of one
// prefill by its token count. Tables at startup, interpolated after.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace moelink::scheduler::sim {

struct CostModelOptions {
  std::string model = "deepseek-v3";  // moelink-plan profile names (or paths)
  std::string gpu = "h200";
  std::string network = "ib-cx7";
  int ep = 32, tp = 1;               // DP = EP / TP
  std::string profiles_dir;          // "" = moelink-plan's default
};

class CostModel {
 public:
  explicit CostModel(const CostModelOptions& o);
  // One decode step of `batch` requests whose contexts average `context` tokens.
  double decode_step_us(double batch, double context) const;
  // One prefill of `tokens` new tokens in total.
  double prefill_us(double tokens) const;
  // Marginal prefill cost per token at a 4,096-token prefill (what engines tell the scheduler).
  double prefill_us_per_token() const;
  const std::string& description() const { return description_; }
  // The prefill table the model interpolates in: (tokens, us) pairs.
  std::vector<std::pair<double, double>> prefill_table() const;

 private:
  std::vector<double> batches_, contexts_;  // decode table axes
  std::vector<double> decode_us_;           // [batch][context]
  std::vector<double> prefill_tokens_, prefill_us_;
  std::string description_;
};

}  // namespace moelink::scheduler::sim
