#include "moelink/plan/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "moelink/plan/cost.h"

namespace moelink::plan {

MemoryReport memory_report(const ModelSpec& m, const GpuProfile& gpu, const Layout& l, const Workload& w) {
  MemoryReport r;
  const double H = double(m.hidden), wb = m.weight_bytes;
  const double scale = m.quant_block > 0 ? 1 + 4.0 / double(m.quant_block * m.quant_block) : 1;
  const double L = double(m.num_experts) / l.ep;
  const double moe_layers = double(m.num_moe_layers());
  r.routed_expert_bytes = moe_layers * L * m.expert_params() * wb * scale;
  // Attention: projections from the hidden state to the latent are replicated
  // in a TP group (MLA), head-wise weights are split.
  double attn_rep = 0, attn_split = m.attention_params();
  if (m.attention == AttentionKind::kMLA) {
    attn_rep = H * double(m.kv_lora_rank + m.qk_rope_head_dim) + (m.q_lora_rank > 0 ? H * m.q_lora_rank : 0);
    attn_split -= attn_rep;
  }
  r.attention_bytes = double(m.num_layers) * (attn_rep + attn_split / l.tp) * wb * scale;
  r.shared_expert_bytes = moe_layers * m.num_shared_experts * m.expert_params() * wb * scale;
  r.dense_mlp_bytes = double(m.num_dense_layers) * 3 * H * m.dense_intermediate / l.tp * wb * scale;
  r.embedding_bytes = double(m.vocab) * H * (m.tied_embeddings ? 1 : 2) / l.tp * m.embed_bytes;
  r.other_bytes = moe_layers * H * m.num_experts * 4 + double(m.num_layers) * 4 * H * 2;
  if (w.draft_tokens > 0 && m.mtp_layers > 0) {
    // One MoE transformer layer plus the projection of [embedding, hidden].
    r.mtp_bytes = double(m.mtp_layers) *
                  ((L + m.num_shared_experts) * m.expert_params() * wb * scale +
                   (attn_rep + attn_split / l.tp) * wb * scale + 2 * H * H * m.embed_bytes);
  }
  r.weight_bytes = r.routed_expert_bytes + r.attention_bytes + r.shared_expert_bytes + r.dense_mlp_bytes +
                   r.embedding_bytes + r.other_bytes + r.mtp_bytes;
  r.kv_bytes_per_token = m.kv_bytes_per_token();
  if (m.attention == AttentionKind::kGQA) r.kv_bytes_per_token /= std::min<double>(l.tp, double(m.num_kv_heads));
  const double per_request_kv = double(w.kv_len) * r.kv_bytes_per_token;
  r.kv_bytes = double(w.batch) * per_request_kv;
  // Receive buffers sized for the worst case: every rank's tokens on each local
  // expert (moelink: L x (T x G) rows), fp8 in for dispatch and bf16 for combine.
  const double rows_per_request = L * (double(w.query_len()) / l.tp) * l.ep;
  const double buf_per_request = rows_per_request * (dispatch_row_bytes(m) + H * 2);
  r.buffer_bytes = double(w.batch) * buf_per_request;
  r.reserve_bytes = gpu.runtime_reserve_bytes;
  r.capacity_bytes = gpu.hbm_bytes * gpu.usable_fraction;
  r.used_bytes = r.weight_bytes + r.kv_bytes + r.buffer_bytes + r.reserve_bytes;
  r.free_bytes = r.capacity_bytes - r.used_bytes;
  const double room = r.capacity_bytes - r.weight_bytes - r.reserve_bytes;
  r.max_batch = room > 0 ? int(std::floor(room / (per_request_kv + buf_per_request))) : 0;
  return r;
}

void require_fits(const MemoryReport& r, const Layout& l, const Workload& w, const std::string& gpu) {
  if (r.fits()) return;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "layout %s with batch %d x %d KV tokens does not fit on %s: needs %.1f GB per GPU "
                "(weights %.1f, KV %.1f, buffers %.1f, reserve %.1f), has %.1f GB: over by %.1f GB; "
                "at most %d requests per DP group fit",
                l.str().c_str(), w.batch, w.kv_len, gpu.c_str(), r.used_bytes / 1e9, r.weight_bytes / 1e9,
                r.kv_bytes / 1e9, r.buffer_bytes / 1e9, r.reserve_bytes / 1e9, r.capacity_bytes / 1e9,
                -r.free_bytes / 1e9, r.max_batch);
  throw PlanError(buf);
}

}  // namespace moelink::plan
