#include "moelink/plan/cost.h"

#include <algorithm>
#include <cmath>

namespace moelink::plan {

const char* to_string(KernelClass c) {
  switch (c) {
    case KernelClass::kNorm: return "Norm/Elementwise";
    case KernelClass::kGemm: return "GEMM";
    case KernelClass::kBmm: return "BMM";
    case KernelClass::kAttention: return "Attention";
    case KernelClass::kRouter: return "Router";
    case KernelClass::kGroupGemm: return "GroupGEMM";
    case KernelClass::kActivation: return "Activation";
    case KernelClass::kAllReduce: return "AllReduce";
    case KernelClass::kDispatch: return "Dispatch";
    case KernelClass::kCombine: return "Combine";
  }
  return "?";
}

void roofline(Kernel& k, double peak_tflops, double eff_compute, double hbm_gbps, double eff_mem,
              double overhead_us) {
  k.peak_tflops = peak_tflops;
  const double tc = peak_tflops > 0 ? k.flops / (peak_tflops * 1e12 * eff_compute) * 1e6 : 0;
  const double tm = k.bytes / (hbm_gbps * 1e9 * eff_mem) * 1e6;
  k.memory_bound = tm >= tc;
  k.time_us = std::max(tc, tm) + overhead_us;
}

namespace {
double peak_for(double wb, const GpuProfile& gpu) { return wb <= 1 ? gpu.fp8_tflops : gpu.bf16_tflops; }

Kernel elementwise(const std::string& name, int stage, KernelClass cls, double bytes, double flops,
                   const GpuProfile& gpu) {
  Kernel k{name, cls, stage, flops, bytes};
  roofline(k, gpu.bf16_tflops, 0.5, gpu.hbm_gbps, gpu.eff.elementwise_memory, gpu.eff.kernel_overhead_us);
  return k;
}
}  // namespace

Kernel gemm_kernel(const std::string& name, int stage, double m, double k, double n, double wb,
                   double ab, const GpuProfile& gpu) {
  Kernel kr{name, KernelClass::kGemm, stage, 2 * m * k * n, k * n * wb + m * k * ab + m * n * 2};
  kr.m = m;
  roofline(kr, peak_for(wb, gpu), gpu.eff.gemm_compute, gpu.hbm_gbps, gpu.eff.gemm_memory,
           gpu.eff.kernel_overhead_us);
  return kr;
}

Kernel group_gemm_kernel(const std::string& name, int stage, double g, double g_active, double m,
                         double k, double n, double wb, const GpuProfile& gpu) {
  Kernel kr{name, KernelClass::kGroupGemm, stage, 2 * g * m * k * n,
            g_active * k * n * wb + g * m * k * wb + g * m * n * 2};
  kr.m = m;
  roofline(kr, peak_for(wb, gpu), gpu.eff.gemm_compute, gpu.hbm_gbps, gpu.eff.gemm_memory,
           gpu.eff.kernel_overhead_us);
  return kr;
}

LayerShape layer_shape(const ModelSpec& m, const Layout& l, double batch, int query_len) {
  LayerShape s;
  const double E = double(m.num_experts), k = double(m.experts_per_token);
  s.tokens_dp = batch * query_len;
  s.tokens_moe = s.tokens_dp / l.tp;
  s.local_experts = E / l.ep;
  s.tokens_per_expert = s.tokens_moe * k * l.ep / E;
  const double total_tokens = s.tokens_moe * l.ep;  // tokens routed by all EP ranks
  s.active_experts = s.local_experts * (1 - std::pow(1 - k / E, total_tokens));
  // P(no expert of a token on a given rank): choose k of E without the rank's L.
  double p_none = 1;
  for (int i = 0; i < m.experts_per_token; ++i) p_none *= std::max(0.0, (E - s.local_experts - i) / (E - i));
  s.dest_ranks = l.ep * (1 - p_none);
  const int in_node = std::min(l.ep, l.gpus_per_node);
  s.dest_ranks_remote_node = double(l.ep - in_node) * (1 - p_none);
  return s;
}

std::vector<Kernel> layer_compute_kernels(const ModelSpec& m, const GpuProfile& gpu, const Layout& l,
                                          double batch, int query_len, int kv_len, bool moe) {
  std::vector<Kernel> ks;
  const LayerShape s = layer_shape(m, l, batch, query_len);
  const double T = s.tokens_dp, Tm = s.tokens_moe, H = double(m.hidden);
  const double wb = m.weight_bytes, ab = m.weight_bytes;  // activations quantized like the weights
  const double hl = double(m.num_heads) / l.tp;
  const double ovh = gpu.eff.kernel_overhead_us;
  auto bmm = [&](const std::string& name, int stage, double kdim, double ndim) {
    Kernel k{name, KernelClass::kBmm, stage, 2 * T * hl * kdim * ndim,
             hl * kdim * ndim * wb + T * hl * (kdim + ndim) * 2};
    k.m = T;
    roofline(k, wb <= 1 ? gpu.fp8_tflops : gpu.bf16_tflops, gpu.eff.gemm_compute, gpu.hbm_gbps,
             gpu.eff.gemm_memory, ovh);
    ks.push_back(k);
  };
  auto attention = [&](double flops, double bytes) {
    Kernel k{"attention", KernelClass::kAttention, 2, flops, bytes};
    roofline(k, gpu.bf16_tflops, gpu.eff.gemm_compute, gpu.hbm_gbps, gpu.eff.attention_memory, ovh);
    ks.push_back(k);
  };

  // Stage 1: InputNorm, QKV projections, AppendKV, BMM (absorbed k_b).
  ks.push_back(elementwise("input_norm", 1, KernelClass::kNorm, T * H * 4, T * H * 4, gpu));
  if (m.attention == AttentionKind::kMLA) {
    const double qk = double(m.qk_nope_head_dim + m.qk_rope_head_dim);
    const double latent = double(m.kv_lora_rank + m.qk_rope_head_dim);
    if (m.q_lora_rank > 0) {
      ks.push_back(gemm_kernel("qkv_a_proj", 1, T, H, double(m.q_lora_rank) + latent, wb, ab, gpu));
      ks.push_back(elementwise("q_kv_a_norm", 1, KernelClass::kNorm,
                               T * double(m.q_lora_rank + m.kv_lora_rank) * 4, 0, gpu));
      ks.push_back(gemm_kernel("q_b_proj", 1, T, double(m.q_lora_rank), hl * qk, wb, ab, gpu));
    } else {
      ks.push_back(gemm_kernel("qkv_a_proj", 1, T, H, hl * qk + latent, wb, ab, gpu));
    }
    bmm("k_b_absorb", 1, double(m.qk_nope_head_dim), double(m.kv_lora_rank));
    ks.push_back(elementwise("rope_append_kv", 1, KernelClass::kNorm, T * latent * 2 * 3, 0, gpu));
    // Stage 2: attention over the latent KV (read once for all queries of a request).
    attention(2 * T * hl * kv_len * (latent + double(m.kv_lora_rank)),
              batch * kv_len * latent * m.kv_bytes + T * hl * (latent + m.kv_lora_rank) * 2);
    bmm("v_b_proj", 2, double(m.kv_lora_rank), double(m.v_head_dim));
    ks.push_back(gemm_kernel("o_proj", 2, T, hl * m.v_head_dim, H, wb, ab, gpu));
  } else {
    const double hd = double(m.head_dim);
    const double kvl = std::max(1.0, double(m.num_kv_heads) / l.tp);
    ks.push_back(gemm_kernel("qkv_proj", 1, T, H, (hl + 2 * kvl) * hd, wb, ab, gpu));
    ks.push_back(elementwise("rope_append_kv", 1, KernelClass::kNorm, T * (hl + 2 * kvl) * hd * 2 * 2, 0, gpu));
    attention(4 * T * hl * kv_len * hd, batch * kv_len * 2 * kvl * hd * m.kv_bytes + T * hl * hd * 4);
    ks.push_back(gemm_kernel("o_proj", 2, T, hl * hd, H, wb, ab, gpu));
  }
  if (l.tp > 1) {
    // Ring all-reduce of the attention output inside the node.
    Kernel k{"tp_allreduce", KernelClass::kAllReduce, 2, 0, 2.0 * (l.tp - 1) / l.tp * T * H * 2};
    k.time_us = ovh + 5 + k.bytes / (gpu.nvlink_gbps * 1e9 * 0.7) * 1e6;
    ks.push_back(k);
  }
  ks.push_back(elementwise("post_norm", 2, KernelClass::kNorm, T * H * 4, T * H * 4, gpu));

  if (!moe) {
    const double I = double(m.dense_intermediate) / l.tp;
    ks.push_back(gemm_kernel("mlp_gate_up", 4, T, H, 2 * I, wb, ab, gpu));
    ks.push_back(elementwise("mlp_act", 4, KernelClass::kActivation, T * I * 5, T * I * 4, gpu));
    ks.push_back(gemm_kernel("mlp_down", 4, T, I, H, wb, ab, gpu));
    if (l.tp > 1) {
      Kernel k{"tp_allreduce_mlp", KernelClass::kAllReduce, 4, 0, 2.0 * (l.tp - 1) / l.tp * T * H * 2};
      k.time_us = ovh + 5 + k.bytes / (gpu.nvlink_gbps * 1e9 * 0.7) * 1e6;
      ks.push_back(k);
    }
    return ks;
  }
  // Router (gate GEMM + top-k) on the tokens this GPU dispatches.
  {
    const double E = double(m.num_experts);
    Kernel k{"router", KernelClass::kRouter, 2, 2 * Tm * H * E, H * E * 2 + Tm * H * 2 + Tm * E * 4};
    roofline(k, gpu.bf16_tflops, gpu.eff.gemm_compute, gpu.hbm_gbps, gpu.eff.gemm_memory, 2 * ovh);
    ks.push_back(k);
  }
  // Stage 3: shared expert (replicated on every GPU).
  if (m.num_shared_experts > 0) {
    const double I = double(m.moe_intermediate) * m.num_shared_experts;
    Kernel a = gemm_kernel("shared_gate_up", 3, Tm, H, 2 * I, wb, ab, gpu);
    Kernel b = elementwise("shared_act", 3, KernelClass::kActivation, Tm * I * 5, Tm * I * 4, gpu);
    Kernel c = gemm_kernel("shared_down", 3, Tm, I, H, wb, ab, gpu);
    ks.push_back(a);
    ks.push_back(b);
    ks.push_back(c);
  }
  // Stage 4: routed experts.
  const double I = double(m.moe_intermediate);
  const double rows = s.local_experts * s.tokens_per_expert;
  ks.push_back(group_gemm_kernel("moe_gate_up", 4, s.local_experts, s.active_experts, s.tokens_per_expert,
                                 H, 2 * I, wb, gpu));
  ks.push_back(elementwise("moe_act_quant", 4, KernelClass::kActivation, rows * I * 5, rows * I * 4, gpu));
  ks.push_back(group_gemm_kernel("moe_down", 4, s.local_experts, s.active_experts, s.tokens_per_expert,
                                 I, H, wb, gpu));
  return ks;
}

namespace {
CommCost comm_cost(const GpuProfile& gpu, const NetworkProfile& net, const Layout& l, const LayerShape& s,
                   double row_bytes, double send_local_bytes, double recv_local_bytes) {
  CommCost c;
  const int in_node = std::min(l.ep, l.gpus_per_node);
  const double p_dest = l.ep > 0 ? s.dest_ranks / l.ep : 0;  // P(a given rank is a destination)
  c.bytes_nvlink = s.tokens_moe * (in_node - 1) * p_dest * row_bytes;
  c.bytes_network = s.tokens_moe * s.dest_ranks_remote_node * row_bytes;
  const double t_nv = c.bytes_nvlink / (gpu.nvlink_gbps * 1e9 * net.nvlink_efficiency) * 1e6;
  const double t_net = c.bytes_network > 0 ? c.bytes_network / (net.gbps_per_gpu * 1e9 * net.efficiency) * 1e6 : 0;
  const double lat = l.ep > l.gpus_per_node ? net.latency_us : net.nvlink_latency_us;
  c.transfer_us = (l.ep > 1 ? lat : 0) + std::max(t_nv, t_net);
  const double bw = gpu.hbm_gbps * 1e9 * gpu.eff.elementwise_memory;
  const double kern = gpu.eff.kernel_overhead_us + (l.ep > l.gpus_per_node ? net.kernel_us : 0);
  c.send_us = kern + send_local_bytes / bw * 1e6;
  c.recv_us = kern + recv_local_bytes / bw * 1e6;
  if (net.nvlink_transfer_in_kernel && l.ep <= l.gpus_per_node) {
    // Single node, copies done by the kernels: nothing left in flight to hide.
    c.send_us += c.transfer_us;
    c.transfer_us = 0;
  }
  return c;
}
}  // namespace

double dispatch_row_bytes(const ModelSpec& m) {
  const double H = double(m.hidden);
  return m.weight_bytes <= 1 ? H + 4.0 * std::ceil(H / 128.0) : H * 2;
}

CommCost dispatch_cost(const ModelSpec& m, const GpuProfile& gpu, const NetworkProfile& net, const Layout& l,
                       const LayerShape& s) {
  const double row = dispatch_row_bytes(m);
  const double recv_rows = s.local_experts * s.tokens_per_expert;
  return comm_cost(gpu, net, l, s, row, s.tokens_moe * row, recv_rows * row * 2);
}

CommCost combine_cost(const ModelSpec& m, const GpuProfile& gpu, const NetworkProfile& net, const Layout& l,
                      const LayerShape& s) {
  const double row = double(m.hidden) * 2;
  const double sent_rows = s.local_experts * s.tokens_per_expert;
  return comm_cost(gpu, net, l, s, row, sent_rows * row, s.tokens_moe * m.experts_per_token * row + s.tokens_moe * row);
}

}  // namespace moelink::plan
