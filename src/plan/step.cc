#include "moelink/plan/step.h"

#include <algorithm>

#include "moelink/plan/calibration.h"

namespace moelink::plan {

LayerTiming layer_timing(const PlanInput& in, double batch, int query_len, bool moe) {
  LayerTiming t;
  const bool mb = moe && in.work.overlap == OverlapMode::kMicroBatch;
  const double b = mb ? batch / 2 : batch;
  t.kernels = layer_compute_kernels(in.model, in.gpu, in.layout, b, query_len, in.work.kv_len, moe);
  const LayerShape s = layer_shape(in.model, in.layout, b, query_len);
  // Measured times where a --calibrate file describes this layout, or
  // stands in for one of its EP ranks (its experts' kernels only), in
  // tokens per rank (per micro-batch under kMicroBatch), in the files'
  // order; an attention bench file measures the attention step of both
  // layer kinds (in requests), the others the MoE layer's kernels.
  std::vector<const Calibration*> cals;
  // The same layer's modelled kernels at another token count per rank (a
  // calibration's largest batch, where `tokens` lies past it).
  const auto model_at = [&](double tokens) {
    return layer_compute_kernels(in.model, in.gpu, in.layout, s.tokens_moe > 0 ? b * tokens / s.tokens_moe : 0,
                                 query_len, in.work.kv_len, moe);
  };
  const long hidden = long(in.model.hidden);
  const int experts = int(in.model.num_experts);
  const int local_heads = int(in.model.num_heads / in.layout.tp);
  for (const Calibration* cal : in.calibrations) {
    if (cal->format == Calibration::Format::kAttentionBench) {
      if (cal->attention_mismatch(hidden, int(in.model.kv_lora_rank), local_heads, query_len, in.work.kv_len)
              .empty())
        cal->apply_attention(t.kernels, local_heads, query_len, in.work.kv_len, b);
      continue;
    }
    if (!moe) continue;
    if (cal->applies(in.layout.ep, hidden, experts)) {
      cal->apply(t.kernels, s.tokens_moe, false, model_at);
      cals.push_back(cal);
    } else if (in.layout.ep > 1 && cal->stand_in_ep(hidden, experts) == in.layout.ep) {
      cal->apply(t.kernels, s.tokens_moe, true, model_at);
    }
  }
  const double copies = mb ? 2 : 1;
  double stage[6] = {0, 0, 0, 0, 0, 0};
  double compute = 0;
  for (const auto& k : t.kernels) {
    t.class_us[int(k.cls)] += copies * k.time_us;
    stage[k.stage] += k.time_us;
    compute += copies * k.time_us;
  }
  if (!moe) {
    t.total_us = compute;
    return t;
  }
  t.dispatch = dispatch_cost(in.model, in.gpu, in.net, in.layout, s);
  t.combine = combine_cost(in.model, in.gpu, in.net, in.layout, s);
  for (const Calibration* cal : cals) {
    cal->apply(t.dispatch, "dispatch", s.tokens_moe);
    cal->apply(t.combine, "combine", s.tokens_moe);
  }
  const CommCost& d = t.dispatch;
  const CommCost& c = t.combine;
  double d_exposed = 0, c_exposed = 0;
  switch (in.work.overlap) {
    case OverlapMode::kNone:
      d_exposed = d.total_us();
      c_exposed = c.total_us();
      break;
    case OverlapMode::kDispatchOverlap:
      // The shared expert runs between dispatch send and receive.
      d_exposed = d.total_us() - std::min(stage[3], d.transfer_us);
      c_exposed = c.total_us();
      break;
    case OverlapMode::kMicroBatch: {
      // Order per layer: A1 B4 A2 B5 A3 B1 A4 B2 A5 B3 (A, B offset by 3 stages).
      // A dispatch sent in stage 3 is hidden by its own shared expert and the
      // other micro-batch's stage 1; a combine sent at the end of stage 4 by
      // the other micro-batch's stage 2.
      const double wait_d = std::max(0.0, d.transfer_us - stage[3] - stage[1]);
      const double wait_c = std::max(0.0, c.transfer_us - stage[2]);
      d_exposed = 2 * (d.send_us + d.recv_us + wait_d);
      c_exposed = 2 * (c.send_us + c.recv_us + wait_c);
      break;
    }
  }
  t.class_us[int(KernelClass::kDispatch)] = d_exposed;
  t.class_us[int(KernelClass::kCombine)] = c_exposed;
  t.exposed_comm_us = d_exposed + c_exposed;
  t.total_us = compute + t.exposed_comm_us;
  return t;
}

namespace {
double head_time(const PlanInput& in, double tokens_dp) {
  const auto& m = in.model;
  Kernel k = gemm_kernel("lm_head", 5, tokens_dp, double(m.hidden), double(m.vocab) / in.layout.tp,
                         m.embed_bytes, 2, in.gpu);
  return k.time_us + in.gpu.eff.kernel_overhead_us * 2;  // + final norm, sampling
}
}  // namespace

StepResult simulate_step(const PlanInput& in) {
  StepResult r;
  const int q = in.work.query_len();
  const double batch = in.work.batch;
  r.shape = layer_shape(in.model, in.layout, batch, q);
  r.tokens_per_expert = r.shape.tokens_per_expert;
  r.moe_layer = layer_timing(in, batch, q, true);
  double layers = double(in.model.num_moe_layers()) * r.moe_layer.total_us;
  if (in.model.num_dense_layers > 0) {
    r.dense_layer = layer_timing(in, batch, q, false);
    layers += double(in.model.num_dense_layers) * r.dense_layer.total_us;
  }
  r.head_us = head_time(in, batch * q) + in.gpu.eff.step_overhead_us;
  // Each MTP draft token: one MoE transformer layer and the shared lm_head at query length 1.
  if (in.work.draft_tokens > 0) {
    const LayerTiming draft = layer_timing(in, batch, 1, true);
    r.draft_us = in.work.draft_tokens * (draft.total_us + head_time(in, batch));
  }
  r.step_us = layers + r.head_us + r.draft_us;
  r.tokens_per_step = in.work.tokens_per_step();
  r.output_tok_s = r.tokens_per_step / r.step_us * 1e6;
  const double total = double(in.layout.dp) * batch * r.output_tok_s;
  r.throughput_gpu = total / in.layout.gpus();
  r.throughput_node = total / in.layout.nodes();
  return r;
}

}  // namespace moelink::plan
