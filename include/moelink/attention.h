// MLAAttention: the attention half of a DeepSeek-V3 decoder layer
// (multi-head latent attention; seed article 002), on a paged latent KV cache.
//
// Notation: D hidden_size, Hq = num_heads / tp_size heads on this rank, Rq
// q_lora_rank, R kv_lora_rank (the latent), Dn qk_nope_head_dim, Dr
// qk_rope_head_dim, Dv v_head_dim, Dc = R + Dr elements per cache row, P
// page_size, n the rows of x.
//
// For each query token t of a request (HF's DeepseekV3Attention):
//   h      = input_layernorm(x[t])                  (when the weight is given)
//   [qa | ckv | kpe] = h . qkv_a^T                   (q_a_proj and kv_a_proj_with_mqa, one GEMM)
//   q      = q_b_proj(q_a_layernorm(qa))            [Hq, Dn + Dr]
//   c      = kv_a_layernorm(ckv)                    [R]  \ the token's cache row,
//   kr     = rope(kpe, position)                    [Dr] / written at its position
//   qr     = rope(q[:, Dn:], position)
//   score(s) = (q_nope . k_nope(s) + qr . kr(s)) * softmax_scale over the
//            request's tokens s <= the token's position, k_nope(s) and v(s)
//            from kv_b_proj . c(s)
//   out[t] = o_proj(sum_s softmax(score)(s) v(s))
// Decode requests compute it absorbed (q_nope . W_UK into the latent space,
// scores over the Dc-wide cache rows, the latent output through W_UV);
// prefill chunks in MHA form (kv_b_proj expands their cached latent to
// per-head keys and values). Every projection is an fp8 GEMM with 128 x 128
// weight blocks on activations quantized per 1 x 128 group (DeepSeek-V3's
// format), k_b / v_b a batched one over the heads.
//
// With tensor parallelism the heads split over tp_size ranks (latent and
// cache replicated): `out` is this rank's partial o_proj sum, which the
// caller reduces over the TP group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moelink/types.h"

namespace moelink {

// Hugging Face's rope_scaling of DeepSeek-V3 ("type": "yarn"). An empty type
// means plain RoPE.
struct RopeScaling {
  std::string type;  // "" or "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// The attention's architecture; field names follow config.json.
struct MLAConfig {
  int hidden_size = 0;           // D, a multiple of 128
  int num_attention_heads = 0;   // all heads (before TP)
  int q_lora_rank = 0;           // Rq, a multiple of 128
  int kv_lora_rank = 0;          // R, a multiple of 128
  int qk_nope_head_dim = 128;    // Dn, a multiple of 128
  int qk_rope_head_dim = 64;     // Dr, even, at most 256
  int v_head_dim = 128;          // Dv, a multiple of 128
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // The rotary dims pair up as (2i, 2i + 1) (DeepSeek's checkpoints, HF's
  // rope_interleave, the default) or as (i, i + Dr/2).
  bool rope_interleave = true;

  static MLAConfig deepseek_v3();  // also DeepSeek-R1: 128 heads, YaRN x40
  static MLAConfig kimi_k2();      // 64 heads, YaRN x32, rope_theta 50000
  // "deepseek-v3", "deepseek-r1", "kimi-k2".
  static MLAConfig preset(const std::string& name);
  // From a Hugging Face config.json (text).
  static MLAConfig from_hf_config_json(const std::string& json_text);

  int cache_row() const { return kv_lora_rank + qk_rope_head_dim; }  // Dc
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // 1 / sqrt(Dn + Dr), times YaRN's mscale(factor, mscale_all_dim) squared.
  double softmax_scale() const;
  // Bytes one token's cache rows take over `num_layers` layers (bf16):
  // 576 x 2 x 61 = 70,272 for DeepSeek-V3, the seed's figure.
  int64_t cache_bytes_per_token(int num_layers) const { return int64_t{cache_row()} * 2 * num_layers; }
  // Throws InvalidArgument naming the field, its value and the rule.
  void validate() const;
  std::string to_string() const;
};

enum class AttentionDevice {
  kCUDA,  // the current CUDA device (Hopper)
  kCPU,   // plain loops on host tensors (tests, CI, the host backends)
};

// The kernel of the absorbed decode attention on CUDA.
enum class MLADecodeKernel {
  // FlashInfer's MLA kernel where it applies (a build with FlashInfer's
  // headers, kv_lora_rank 512, qk_rope_head_dim 64, an eager call or a
  // capture given MLABatch's host copies), else moelink's own. (Not yet
  // FlashMLA's: docs/attention.md.)
  kAuto,
  kFlashInfer,  // always FlashInfer's (create() refuses where it cannot)
  kMoelink,     // always moelink's own kernel (any shape, CUDA graphs)
  // Always FlashMLA's (deepseek-ai/FlashMLA's sm90 dense decode; create()
  // refuses where it cannot): every query row a request of one token over
  // its own keys, so q_len 1 and 2 mix; read on the device only (CUDA
  // graphs need no host copies).
  kFlashMLA,
};

// The kernel of the prefill attention (MHA form) on CUDA.
enum class MLAPrefillKernel {
  // FlashInfer's Hopper prefill kernel (FA3) where it applies (a build with
  // FlashInfer's headers, qk_nope_head_dim 128, qk_rope_head_dim 64,
  // v_head_dim 128), else moelink's own.
  kAuto,
  kFlashInfer,  // always FlashInfer's (create() refuses where it cannot)
  kMoelink,     // always moelink's own kernel (any shape; the reference)
};

// The absorbed decode's per-head GEMMs: q_nope through W_UK^T into the
// latent space, the latent output through W_UV (kv_b_proj's two halves).
enum class MLAHeadGemm {
  // fp8 block-scaled weights, the activations quantized 1 x 128, moelink's
  // fp8 grouped GEMM a head a group (the seed's fp8 BMM; half the weight
  // bytes).
  kFp8,
  // bf16 weights (kv_b_proj's blocks dequantized at load: 2 x Hq x 128 x
  // 512 x 2 bytes, 33.5 MB a layer at 128 heads), bf16 activations, fp32
  // accumulation: cuBLAS's strided batched GEMM on CUDA. The default: the
  // EP8-shaped model's decode step took 3860 / 6605 us at 1 / 128 requests
  // against fp8's 4280 / 6980 on an H100, three interleaved rounds
  // (docs/attention.md).
  kBf16,
};

struct MLAOptions {
  AttentionDevice device = AttentionDevice::kCUDA;
  MLADecodeKernel decode_kernel = MLADecodeKernel::kAuto;    // CUDA only
  MLAPrefillKernel prefill_kernel = MLAPrefillKernel::kAuto;  // CUDA only
  MLAHeadGemm head_gemm = MLAHeadGemm::kBf16;
  int tp_size = 1;  // heads split over this many ranks: 1, 2, 4, 8, ... dividing num_attention_heads
  int tp_rank = 0;  // this rank's heads: tp_rank * Hq .. tp_rank * Hq + Hq - 1
  int page_size = 64;            // P: cache rows per page, a multiple of 16
  int64_t max_tokens = 0;        // rows of x one forward() may carry, 1..65536
  int max_requests = 0;          // requests one forward() may carry, 1..65536
  int max_pages_per_request = 0; // columns of the block table, >= 1
  // Run check() after every call (synchronizing the stream). < 0: read
  // MOELINK_DEBUG.
  int debug = -1;
};

// The weights in Hugging Face's layout and names (model.layers.N.self_attn.*),
// all heads (the object takes its TP rank's slice): fp8 e4m3 with their
// 128 x 128 block scales (weight_scale_inv; kv_a_proj_with_mqa's last block
// row holds Dr = 64 rows), or bf16 / fp32 (quantized to blocks here). Host
// or device memory; set_weights copies them.
struct MLAWeights {
  Tensor input_layernorm;                      // [D] bf16 or fp32; undefined: x is already normed
  Tensor q_a_proj, q_a_proj_scale;             // [Rq, D], [Rq/128, D/128]
  Tensor q_a_layernorm;                        // [Rq]
  Tensor kv_a_proj_with_mqa, kv_a_proj_with_mqa_scale;  // [R + Dr, D], [ceil((R + Dr)/128), D/128]
  Tensor kv_a_layernorm;                       // [R]
  Tensor q_b_proj, q_b_proj_scale;             // [heads * (Dn + Dr), Rq], [.../128, Rq/128]
  Tensor kv_b_proj, kv_b_proj_scale;           // [heads * (Dn + Dv), R], [.../128, R/128]
  Tensor o_proj, o_proj_scale;                 // [D, heads * Dv], [D/128, heads * Dv/128]
};

// One step's requests, in the object's memory kind (device for kCUDA, host
// for kCPU). The first num_decode requests decode (1 or 2 query tokens each,
// two for MTP verification: absorbed MLA on the latent cache); the others
// are prefill chunks (any number of query tokens; MHA form). Request i's
// query tokens are rows q_start[i] .. q_start[i+1] - 1 of x and out; they are
// the last q_len_i = q_start[i+1] - q_start[i] of its kv_len[i] tokens, at
// positions kv_len[i] - q_len_i .. kv_len[i] - 1 (their RoPE positions and
// cache slots), and each attends to its request's tokens up to its own
// position. Token p of request i lives in page block_table[i][p / P], row
// p % P; forward() writes the query tokens' rows there (AppendKV) before
// attending, and reads the earlier ones as they are.
struct MLABatch {
  int num_requests = 0;  // B, host-known: 0..max_requests
  int num_decode = 0;    // host-known: 0..B
  Tensor q_start;        // [B + 1] int32: q_start[0] = 0, non-decreasing, q_start[B] <= n
  Tensor kv_len;         // [B] int32: q_len_i <= kv_len[i] <= pages in the row * P
  Tensor block_table;    // [B, max_pages] int32 (any row stride): page ids in [0, num_pages)
  // Optional, CUDA path: host copies of q_start, kv_len and block_table
  // holding the same values (the engine builds its steps on the host).
  // FlashInfer's decode then plans from them instead of reading the
  // device's back, which synchronizes the stream once a layer.
  Tensor host_q_start, host_kv_len, host_block_table;
  // Which of the attention's kMLAPlanSlots FlashInfer decode plans this
  // batch uses: a model step in a CUDA graph plans three batches (the whole
  // step's, and its two micro-batches') and each keeps its own plan for the
  // replays (prepare_graph_replay with the same slot). Other callers: 0.
  int plan_slot = 0;
};
inline constexpr int kMLAPlanSlots = 3;

namespace detail {
class MLAAttentionImpl;
}

class MLAAttention {
 public:
  // share_with: another layer whose scratch this one uses too (the
  // attention ops with FlashInfer's workspaces and plans, the GEMMs'
  // workspaces, the activations), allocating only its own weights. For
  // layers that run one after another on one stream, as a model's do:
  // nothing in it outlives a forward(), and FlashInfer's decode plans a
  // batch once for all of them. It must have the same config shapes and
  // options (InvalidArgument naming the field otherwise); the scratch lives
  // as long as any layer using it.
  static std::unique_ptr<MLAAttention> create(const MLAConfig& config, const MLAOptions& options,
                                              const MLAAttention* share_with = nullptr);
  ~MLAAttention();
  MLAAttention(const MLAAttention&) = delete;
  MLAAttention& operator=(const MLAAttention&) = delete;

  const MLAConfig& config() const;
  const MLAOptions& options() const;
  int local_heads() const;  // Hq

  // Copies the weights in (checks every shape and dtype, naming the field).
  void set_weights(const MLAWeights& w);
  // model.layers.<layer_index>.{input_layernorm, self_attn.*} of a Hugging
  // Face checkpoint directory (safetensors; fp8 with weight_scale_inv, or
  // bf16). A missing tensor, a wrong shape or dtype throws InvalidArgument
  // naming the tensor and the file.
  void load_checkpoint(const std::string& directory, int layer_index);

  //   out      [n, D] bf16 (rows >= q_start[B] untouched; this TP rank's
  //            partial sum when tp_size > 1)
  //   x        [n, D] bf16 hidden states, rows contiguous; n <= max_tokens
  //   kv_cache [num_pages, P, Dc] bf16, contiguous: this layer's cache
  // Values that do not fit are found while the step runs, and nothing is
  // read or written out of bounds: a page id outside the cache or a length
  // beyond the request's pages or below its query tokens skips that request
  // (its rows of out are zero, its cache rows unwritten); q_start out of
  // order or past n, or a decode request of more than 2 tokens, skips the
  // whole step (out untouched). check() raises InputError naming the
  // field, the request and the value.
  void forward(const Tensor& out, const Tensor& x, const MLABatch& batch, const Tensor& kv_cache,
               cudaStream_t stream = nullptr);

  // Before each replay of a CUDA graph that captured forward(): FlashInfer's
  // decode (decode_kernel auto or flashinfer, captured with MLABatch's host
  // copies) plans on the host, so its schedule for the replay's batch is
  // made here from `batch`'s host copies (the graph's device tensors hold
  // the same values by the time it runs; the previous replay must have
  // finished). The graph is found by the batch's num_decode: one graph per
  // batch size (the last capture of a size is the one replayed); eager
  // steps in between do not disturb it. Throws InvalidArgument, naming
  // what, for a batch FlashInfer's captured decode cannot run (capture
  // again or run eagerly). Nothing to do for moelink's kernel or on the CPU.
  void prepare_graph_replay(const MLABatch& batch, const Tensor& kv_cache);

  // Waits for the work on `stream` and throws InputError for what the step
  // flagged since the last check(), once.
  void check(cudaStream_t stream = nullptr);

 private:
  explicit MLAAttention(std::unique_ptr<detail::MLAAttentionImpl> impl);
  std::unique_ptr<detail::MLAAttentionImpl> impl_;
};

}  // namespace moelink
