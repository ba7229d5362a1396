// The router after the gate GEMM, for one token's logits z[E] (fp32):
//   s[e] = sigmoid(z[e])  or  softmax(z)[e]
//   c[e] = s[e] + bias[e]                       (with e_score_correction_bias)
//   n_group > 1: a group scores the sum of its two largest c; the topk_group
//     best groups stay, the other groups' experts drop out
//   indices = the k experts of largest c, best first (ties: lower expert id)
//   weights[i] = s[indices[i]], divided by their sum (+1e-20) when
//     norm_topk_prob, times routed_scaling_factor
// which is DeepSeek-V3's noaux_tc routing; Mixtral's and Qwen3's softmax
// top-k are the one-group case. The CPU loop (router_cpu.cc) and the CUDA
// kernel (cuda/router_kernels.cu, a warp per token) follow it step for step.
#pragma once

#include <cstdint>

#include "moelink/moe_layer.h"

namespace moelink::detail::layer {

struct RouterParams {
  int num_experts;  // E <= 1024
  int top_k;        // <= 16
  int n_group;      // <= 32
  int topk_group;
  bool sigmoid;     // else softmax
  bool has_bias;
  bool norm_topk_prob;
  float routed_scaling_factor;
};
RouterParams router_params(const MoEModelConfig& m);

// rows rows of logits [rows, E] (row stride `logits_stride`), bias [E] or
// null; writes indices and weights [rows, k] with the given row strides.
void route_cpu(const float* logits, int64_t logits_stride, const float* bias, const RouterParams& p,
               int64_t rows, int32_t* indices, int64_t indices_stride, float* weights,
               int64_t weights_stride);

}  // namespace moelink::detail::layer
