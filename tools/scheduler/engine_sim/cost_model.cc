#include "cost_model.h"

#include <algorithm>
#include <cstdio>

#include "moelink/plan/profiles.h"
#include "moelink/plan/step.h"

namespace moelink::scheduler::sim {
namespace {

// Linear interpolation in a sorted table, clamped... beyond the last point
// the last segment's slope continues (prefill and decode grow on).
double interpolate(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
  if (x <= xs.front()) return ys.front() * (xs.front() > 0 ? std::max(x, 0.0) / xs.front() : 1.0);
  size_t i = 1;
  while (i + 1 < xs.size() && xs[i] < x) ++i;
  const double t = (x - xs[i - 1]) / (xs[i] - xs[i - 1]);
  return ys[i - 1] + t * (ys[i] - ys[i - 1]);
}

}  // namespace

CostModel::CostModel(const CostModelOptions& o) {
  plan::ProfileStore store(o.profiles_dir.empty() ? plan::default_profiles_dir() : o.profiles_dir);
  plan::PlanInput in;
  in.model = store.model(o.model);
  in.gpu = store.gpu(o.gpu);
  in.net = store.network(o.network);
  in.layout.ep = o.ep;
  in.layout.tp = o.tp;
  in.layout.dp = o.ep / o.tp;
  in.layout.gpus_per_node = in.gpu.gpus_per_node;
  plan::validate(in.layout, in.model, in.net);
  in.work.draft_tokens = 0;  // one token per step
  in.work.overlap = plan::OverlapMode::kDispatchOverlap;

  batches_ = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  contexts_ = {256, 1024, 4096, 16384, 65536};
  for (double b : batches_)
    for (double c : contexts_) {
      in.work.batch = static_cast<int>(b);
      in.work.kv_len = static_cast<int>(c);
      decode_us_.push_back(plan::simulate_step(in).step_us);
    }
  // Prefill as DeepSeek-V3's prefill deployment runs it: two micro-batches,
  // each one's dispatch and combine hidden behind the other's compute.
  in.work.kv_len = 4096;
  in.work.overlap = plan::OverlapMode::kMicroBatch;
  for (double t : {1.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0}) {
    const int q = static_cast<int>(t);
    double us = static_cast<double>(in.model.num_moe_layers()) * plan::layer_timing(in, 1, q, true).total_us;
    if (in.model.num_dense_layers > 0)
      us += static_cast<double>(in.model.num_dense_layers) * plan::layer_timing(in, 1, q, false).total_us;
    prefill_tokens_.push_back(t);
    prefill_us_.push_back(us + in.gpu.eff.step_overhead_us);
  }
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s on %s, %s, one DP group of EP%d TP%d", in.model.name.c_str(),
                in.gpu.name.c_str(), in.net.name.c_str(), o.ep, o.tp);
  description_ = buf;
}

double CostModel::decode_step_us(double batch, double context) const {
  batch = std::max(1.0, batch);
  context = std::clamp(context, contexts_.front(), contexts_.back());
  // Interpolate in context at the two neighbouring batch rows, then in batch.
  std::vector<double> by_batch;
  for (size_t b = 0; b < batches_.size(); ++b) {
    std::vector<double> row(decode_us_.begin() + static_cast<std::ptrdiff_t>(b * contexts_.size()),
                            decode_us_.begin() + static_cast<std::ptrdiff_t>((b + 1) * contexts_.size()));
    by_batch.push_back(interpolate(contexts_, row, context));
  }
  if (batch <= batches_.front()) return by_batch.front();
  return interpolate(batches_, by_batch, batch);
}

double CostModel::prefill_us(double tokens) const {
  if (tokens <= 0) return 0;
  if (tokens <= prefill_tokens_.front()) return prefill_us_.front();
  return interpolate(prefill_tokens_, prefill_us_, tokens);
}

std::vector<std::pair<double, double>> CostModel::prefill_table() const {
  std::vector<std::pair<double, double>> t;
  for (size_t i = 0; i < prefill_tokens_.size(); ++i) t.push_back({prefill_tokens_[i], prefill_us_[i]});
  return t;
}

double CostModel::prefill_us_per_token() const {
  return (prefill_us(8192) - prefill_us(4096)) / 4096.0;
}

}  // namespace moelink::scheduler::sim
