// AttentionOps on the current CUDA device: cudaMalloc'd memory and the
// kernels of attention_kernels.cu, each step on the caller's stream; the
// decode attention on FlashMLA's or FlashInfer's MLA kernel and the prefill
// on FlashInfer's Hopper prefill kernel where they apply
// (MLAOptions.decode_kernel, prefill_kernel).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention/attention_ops.h"
#include "attention/cuda/attention_kernels.h"
#include "attention/cuda/flashinfer_mla.h"
#include "attention/cuda/flashinfer_prefill.h"
#include "attention/cuda/flashmla_decode.h"
#include "attention/cuda/mla_decode_tc.h"
#include "attention/prefill_calls.h"
#include "moelink/errors.h"
#include "nvlink/cublas_handles.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_memory.h"
#include "nvlink/cuda_release.h"
#include "nvlink/rms_norm.h"

namespace moelink::detail::attention {

namespace {

uint16_t* bf16_data(const Tensor& t) { return static_cast<uint16_t*>(t.data); }

// A prefill request's running softmax, in memory the ops object keeps
// (grown as needed; one request at a time).
struct CudaPrefillState final : AttentionOps::PrefillState {
  PrefillSoftmax softmax{};
};

class CudaAttentionOps final : public CudaMemory<AttentionOps> {
 public:
  CudaAttentionOps(const MLAConfig& c, int local_heads, const MLAOptions& o) : kernel_(o.decode_kernel) {
    const MLADecodeKernel kernel = o.decode_kernel;
    const MLAPrefillKernel prefill = o.prefill_kernel;
    const bool shapes = c.kv_lora_rank == FlashInferMLA::kLatent && c.qk_rope_head_dim == FlashInferMLA::kRope;
    if (kernel == MLADecodeKernel::kFlashInfer && !FlashInferMLA::built())
      throw InvalidArgument("moelink: MLAAttention: MLAOptions.decode_kernel = flashinfer, but this build "
                            "has no FlashInfer headers (configure with MOELINK_FLASHINFER_DIR)");
    if (kernel == MLADecodeKernel::kFlashInfer && !shapes)
      throw InvalidArgument("moelink: MLAAttention: MLAOptions.decode_kernel = flashinfer needs "
                            "kv_lora_rank = 512 and qk_rope_head_dim = 64, got " +
                            std::to_string(c.kv_lora_rank) + " and " + std::to_string(c.qk_rope_head_dim));
    if ((kernel == MLADecodeKernel::kAuto || kernel == MLADecodeKernel::kFlashInfer) && FlashInferMLA::built() &&
        shapes)
      flashinfer_[0] = FlashInferMLA::create(local_heads);
    // auto does not take FlashMLA's yet: its path has not run on a GPU
    // (docs/attention.md says what auto will take once it has).
    if (kernel == MLADecodeKernel::kFlashMLA) {
      const std::string why_not = flashmla_refusal(c, local_heads, o);
      if (!why_not.empty())
        throw InvalidArgument("moelink: MLAAttention: MLAOptions.decode_kernel = flashmla " + why_not);
      flashmla_[0] = FlashMLADecode::create(local_heads);
    }
    local_heads_ = local_heads;
    const bool prefill_shapes = c.qk_nope_head_dim + c.qk_rope_head_dim == FlashInferPrefill::kQkDims &&
                                c.qk_rope_head_dim == 64 && c.v_head_dim == FlashInferPrefill::kVDims;
    if (prefill == MLAPrefillKernel::kFlashInfer && !FlashInferPrefill::built())
      throw InvalidArgument("moelink: MLAAttention: MLAOptions.prefill_kernel = flashinfer, but this build "
                            "has no FlashInfer headers (configure with MOELINK_FLASHINFER_DIR)");
    if (prefill == MLAPrefillKernel::kFlashInfer && !prefill_shapes)
      throw InvalidArgument("moelink: MLAAttention: MLAOptions.prefill_kernel = flashinfer needs "
                            "qk_nope_head_dim = 128, qk_rope_head_dim = 64 and v_head_dim = 128, got " +
                            std::to_string(c.qk_nope_head_dim) + ", " + std::to_string(c.qk_rope_head_dim) +
                            " and " + std::to_string(c.v_head_dim));
    if (prefill != MLAPrefillKernel::kMoelink && FlashInferPrefill::built() && prefill_shapes)
      flashinfer_prefill_ = FlashInferPrefill::create();
  }

  void sync(cudaStream_t stream) override { MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  void set_count(int32_t* dst, int32_t value, cudaStream_t stream) override {
    launch_set_count(dst, value, stream);
  }

  void plan_step(const MLABatch& b, int64_t n, const StepBounds& bounds, int local_heads,
                 const RowPlan& plan, StepErrorRecord* error, cudaStream_t stream) override {
    launch_plan_step(b, n, bounds, local_heads, plan, error, stream);
  }

  void rms_norm(const Tensor& y, const Tensor& x, const float* weight, float eps, const int32_t* rows,
                cudaStream_t stream) override {
    launch_residual_rms_norm(bf16_data(x), x.stride[0], nullptr, 0, nullptr, 0, bf16_data(y), y.stride[0],
                             x.shape[1], weight, eps, rows, x.shape[0], stream);
  }

  void rope_q(const Tensor& q, int heads, int head_dim, int rope_dims, const RowPlan& plan,
              const float* inv_freq, float attention_factor, bool interleaved,
              cudaStream_t stream) override {
    launch_rope_q(bf16_data(q), q.stride[0], heads, head_dim, rope_dims, plan, q.shape[0],
                  {inv_freq, attention_factor, interleaved}, stream);
  }

  void append_kv(const Tensor& cache, const Tensor& latent, const Tensor& kpe, const MLABatch& b,
                 const RowPlan& plan, const float* inv_freq, float attention_factor, bool interleaved,
                 cudaStream_t stream) override {
    launch_append_kv(bf16_data(cache), static_cast<int>(cache.shape[1]), bf16_data(latent), latent.stride[0],
                     static_cast<int>(latent.shape[1]), bf16_data(kpe), kpe.stride[0],
                     static_cast<int>(kpe.shape[1]), static_cast<const int32_t*>(b.block_table.data),
                     b.block_table.stride[0], plan, latent.shape[0], {inv_freq, attention_factor, interleaved},
                     stream);
  }

  void split_heads(const Tensor& dst, const Tensor& src, int heads, int64_t head_stride, int64_t offset,
                   const int32_t* rows, cudaStream_t stream) override {
    launch_split_heads(bf16_data(dst), dst.stride[0], dst.stride[1], dst.shape[1], dst.shape[2], bf16_data(src),
                       src.stride[0], heads, head_stride, offset, rows, stream);
  }
  void merge_heads(const Tensor& dst, const Tensor& src, int heads, const int32_t* rows,
                   cudaStream_t stream) override {
    launch_merge_heads(bf16_data(dst), dst.stride[0], bf16_data(src), src.shape[1], src.shape[2], heads, rows,
                       stream);
  }

  void head_gemm(const Tensor& y, const Tensor& x, const uint16_t* w, int64_t rows_bound, const int32_t*,
                 cudaStream_t stream) override {
    const int64_t heads = y.shape[0], N = y.shape[2], K = x.shape[2];
    if (rows_bound <= 0) return;
    const float one = 1.0f, zero = 0.0f;
    PooledCublas::ok(cublasSetStream(cublas_.get(), stream), "cublasSetStream");
    // Column-major, per head: y^T [N, m] = w^T . x^T, where w [N, K]
    // row-major is a [K, N] column-major operand (op T) and x [m, K]
    // row-major a [K, m] one.
    PooledCublas::ok(
        cublasGemmStridedBatchedEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                                   static_cast<int>(rows_bound), static_cast<int>(K), &one, w, CUDA_R_16BF,
                                   static_cast<int>(K), N * K, x.data, CUDA_R_16BF, static_cast<int>(x.stride[1]),
                                   x.stride[0], &zero, y.data, CUDA_R_16BF, static_cast<int>(y.stride[1]),
                                   y.stride[0], static_cast<int>(heads), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx (MLA head GEMM)");
  }

  void decode_attention(const Tensor& out_latent, const Tensor& q_latent, const Tensor& q,
                        const Tensor& cache, const MLABatch& b, const RowPlan& plan, int heads,
                        int nope_dims, float scale, cudaStream_t stream) override {
    const int R = static_cast<int>(q_latent.shape[2]), Dr = static_cast<int>(cache.shape[2]) - R;
    if (q_latent.stride[1] == R + Dr) {  // decode_query_with_rope() said FlashMLA's
      FlashMLADecodeArgs a{};
      a.q = bf16_data(q_latent);
      a.q_stride_head = q_latent.stride[0];
      a.q_stride_row = q_latent.stride[1];
      a.cache = bf16_data(cache);
      a.num_pages = cache.shape[0];
      a.block_table = static_cast<const int32_t*>(b.block_table.data);
      a.block_stride = b.block_table.stride[0];
      a.max_pages = static_cast<int32_t>(b.block_table.shape[1]);
      a.request = plan.request;
      a.position = plan.position;
      a.decode_rows = plan.decode_rows;
      a.out = bf16_data(out_latent);
      a.out_stride_head = out_latent.stride[0];
      a.out_stride_row = out_latent.stride[1];
      // A decode request has one or two query rows (MLAAttention's rule).
      a.rows = static_cast<int>(std::min<int64_t>(q_latent.shape[1], 2 * int64_t{b.num_decode}));
      a.scale = scale;
      flashmla(b.plan_slot).run(a, stream);
      // A capture of this batch size that planned FlashInfer's before runs
      // FlashMLA's now: prepare_replay() has nothing to plan for it.
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      MOELINK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      if (flashinfer_[0] && capturing != cudaStreamCaptureStatusNone)
        flashinfer(b.plan_slot).forget_capture(b.num_decode, stream);
      return;
    }
    if (flashinfer_[0] && flashinfer_plan(b, cache, stream)) {
      const int64_t Nd = q_latent.shape[1];
      const int head_dim = nope_dims + Dr;
      FlashInferMLAArgs a{};
      a.q_latent = bf16_data(q_latent);
      a.q_latent_stride_row = R;
      a.q_latent_stride_head = Nd * R;
      a.q_pe = bf16_data(q) + nope_dims;
      a.q_pe_stride_row = q.stride[0];
      a.q_pe_stride_head = head_dim;
      a.cache = bf16_data(cache);
      a.page_size = static_cast<int>(cache.shape[1]);
      a.block_table = static_cast<const int32_t*>(b.block_table.data);
      a.out = bf16_data(out_latent);
      a.out_stride_row = R;
      a.out_stride_head = Nd * R;
      a.scale = scale;
      flashinfer(b.plan_slot).run(a, stream);
      return;
    }
    if (tc_decode_supported(R, Dr)) {  // moelink's decode on tensor cores
      TcDecodeArgs a{};
      a.out_latent = bf16_data(out_latent);
      a.q_latent = bf16_data(q_latent);
      a.q = bf16_data(q);
      a.q_stride = q.stride[0];
      a.head_dim = nope_dims + Dr;
      a.nope_dims = nope_dims;
      a.cache = bf16_data(cache);
      a.num_pages = cache.shape[0];
      a.page_size = static_cast<int>(cache.shape[1]);
      a.block_table = static_cast<const int32_t*>(b.block_table.data);
      a.block_stride = b.block_table.stride[0];
      a.max_keys = b.block_table.shape[1] * cache.shape[1];
      a.plan = plan;
      a.Nd = q_latent.shape[1];
      // A decode request has one or two query rows (MLAAttention's rule).
      a.rows_bound = std::min<int64_t>(a.Nd, 2 * static_cast<int64_t>(b.num_decode));
      a.R = R;
      a.heads = heads;
      a.scale = scale;
      const size_t ws = tc_decode_workspace_bytes(a);
      launch_tc_decode(a, ws > 0 ? decode_workspace_.get(ws) : nullptr, stream);
      return;
    }
    // The scalar kernel (other latent or rotary sizes): a block per row and head.
    launch_decode_attention(bf16_data(out_latent), bf16_data(q_latent), q_latent.shape[1], R, bf16_data(q),
                            q.stride[0], nope_dims + Dr, nope_dims, bf16_data(cache),
                            static_cast<int>(cache.shape[1]), Dr,
                            static_cast<const int32_t*>(b.block_table.data), b.block_table.stride[0], plan,
                            heads, scale, stream);
  }

  std::unique_ptr<PrefillState> prefill_begin(int64_t query_rows, int heads, int v_dims,
                                              cudaStream_t stream) override {
    const size_t stats = static_cast<size_t>(query_rows) * heads;
    const size_t bytes = (2 * stats + stats * v_dims) * sizeof(float);
    auto s = std::make_unique<CudaPrefillState>();
    float* base = static_cast<float*>(prefill_memory_.get(bytes));
    s->softmax = {base, base + stats, base + 2 * stats, query_rows, heads, v_dims};
    launch_prefill_begin(s->softmax, stream);
    return s;
  }

  void gather_kv(const Tensor& latent, const Tensor& k_pe, const Tensor& cache, const int32_t* block_row,
                 int page_size, int64_t first, int64_t count, cudaStream_t stream) override {
    launch_gather_kv(bf16_data(latent), latent.stride[0], static_cast<int>(latent.shape[1]), bf16_data(k_pe),
                     k_pe.stride[0], static_cast<int>(k_pe.shape[1]), bf16_data(cache), block_row, page_size,
                     first, count, stream);
  }

  void prefill_chunk(PrefillState& state, const Tensor& q, int64_t q_row0, int64_t q_rows, int64_t q_pos0,
                     const Tensor& kv, const Tensor& k_pe, int64_t k_pos0, int heads, int nope_dims,
                     int rope_dims, int v_dims, float scale, cudaStream_t stream) override {
    if (flashinfer_prefill_)
      return flashinfer_prefill_chunk(static_cast<CudaPrefillState&>(state).softmax, q, q_row0, q_rows, q_pos0,
                                      kv, k_pe, k_pos0, heads, nope_dims, rope_dims, v_dims, scale, stream);
    (void)q_rows, (void)heads, (void)v_dims;  // the state's
    launch_prefill_chunk(static_cast<CudaPrefillState&>(state).softmax, bf16_data(q), q.stride[0], q_row0, q_pos0, bf16_data(kv), kv.stride[0],
                         bf16_data(k_pe), k_pe.stride[0], kv.shape[0], k_pos0, nope_dims, rope_dims, scale,
                         stream);
  }

  void prefill_finish(PrefillState& state, const Tensor& out, int64_t row0, cudaStream_t stream) override {
    launch_prefill_finish(static_cast<CudaPrefillState&>(state).softmax, bf16_data(out), out.stride[0], row0, stream);
  }

  void zero_rows(const Tensor& dst, int64_t row0, int64_t rows, cudaStream_t stream) override {
    if (rows == 0) return;
    MOELINK_CUDA_CHECK(cudaMemset2DAsync(bf16_data(dst) + row0 * dst.stride[0], dst.stride[0] * 2, 0,
                                         dst.shape[1] * 2, rows, stream));
  }

  StepErrorRecord take_error(StepErrorRecord* record, cudaStream_t stream) override {
    return take_device_record(stream, record, [](const StepErrorRecord&) { return true; });
  }

  // FlashMLA's decode for decode_kernel = flashmla (where it was made), any
  // batch with decode requests.
  bool decode_query_with_rope(const MLABatch& b, cudaStream_t) override {
    return flashmla_[0] && b.num_decode >= 1;
  }

 private:
  // Why FlashMLA's decode cannot run this attention ("" where it can).
  static std::string flashmla_refusal(const MLAConfig& c, int local_heads, const MLAOptions& o) {
    if (!FlashMLADecode::built())
      return "needs a build with FlashMLA's source (configure with MOELINK_FLASHMLA_DIR)";
    if (c.kv_lora_rank != FlashMLADecode::kLatent || c.qk_rope_head_dim != FlashMLADecode::kRope)
      return "needs kv_lora_rank = 512 and qk_rope_head_dim = 64, got " + std::to_string(c.kv_lora_rank) +
             " and " + std::to_string(c.qk_rope_head_dim);
    if (o.page_size != FlashMLADecode::kPageSize)
      return "needs page_size = 64, got " + std::to_string(o.page_size);
    if (o.head_gemm != MLAHeadGemm::kBf16)
      return "needs head_gemm = bf16 (its query is the latent and the roped dims as one vector, which the "
             "bf16 head GEMM writes)";
    const int64_t decode_rows = std::min<int64_t>(o.max_tokens, 2 * int64_t{o.max_requests});
    if (decode_rows > kFlashMLAMaxRows)
      return "takes at most " + std::to_string(kFlashMLAMaxRows) +
             " decode rows a step (min(max_tokens, 2 max_requests)), got " + std::to_string(decode_rows);
    if (FlashMLADecode::sm_parts(local_heads) > kFlashMLAMaxParts)
      return "cannot split the keys of " + std::to_string(local_heads) + " heads over this GPU's SMs in at most " +
             std::to_string(kFlashMLAMaxParts) + " parts";
    return "";
  }
  static constexpr int kFlashMLAMaxParts = 160;  // FlashMLA's merge kernel's largest instantiation
  // Its scheduler keeps 5 ints a row in shared memory (one block; 160 KB here).
  static constexpr int64_t kFlashMLAMaxRows = 8192;

  FlashMLADecode& flashmla(int slot) {
    if (!flashmla_[slot]) flashmla_[slot] = FlashMLADecode::create(local_heads_);
    return *flashmla_[slot];
  }

  // Plans FlashInfer's kernel for the decode requests from host copies of
  // the batch: the caller's (MLABatch.host_*), or read back from the device
  // after waiting for the stream (eager calls only). Inside a capture the
  // caller's host copies are needed (prepare_replay() re-plans from the next
  // batch's before each replay): without them kFlashInfer refuses and kAuto
  // captures moelink's kernel. False, for moelink's kernel to run instead,
  // then, or when a request is one plan_step() skips (that kernel gives its
  // rows zeros; FlashInfer would read the pages it names).
  bool flashinfer_plan(const MLABatch& b, const Tensor& cache, cudaStream_t stream) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    MOELINK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    const bool capture = capturing != cudaStreamCaptureStatusNone;
    const bool host = b.host_q_start.defined() && b.host_kv_len.defined() && b.host_block_table.defined();
    if (capture) flashinfer(b.plan_slot).forget_capture(b.num_decode, stream);  // until this capture plans it
    if (capture && !host) {
      if (kernel_ == MLADecodeKernel::kFlashInfer)
        throw InvalidArgument("moelink: MLAAttention.forward: MLAOptions.decode_kernel = flashinfer "
                              "is captured in a CUDA graph only with MLABatch's host copies (host_q_start, "
                              "host_kv_len, host_block_table: its plan reads the batch on the host); give "
                              "them, or use auto or moelink");
      return false;
    }
    if (!capture && !host) MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream));  // values from the stream's work
    if (!host_schedule(b, cache, host)) return false;
    flashinfer(b.plan_slot).plan(q_start_.data(), kv_indptr_.data(), kv_len_.data(), b.num_decode, stream);
    return true;
  }

  // A graph captured with FlashInfer's decode at this batch size: its plan
  // for the next replay's batch.
  void prepare_replay(const MLABatch& b, const Tensor& cache) override {
    if (!flashinfer_[0] || !flashinfer(b.plan_slot).captured(b.num_decode)) return;
    if (!(b.host_q_start.defined() && b.host_kv_len.defined() && b.host_block_table.defined()))
      throw InvalidArgument("moelink: MLAAttention.prepare_graph_replay: the graph runs FlashInfer's decode, "
                            "whose plan needs MLABatch's host copies (host_q_start, host_kv_len, "
                            "host_block_table)");
    if (!host_schedule(b, cache, true))
      throw InvalidArgument("moelink: MLAAttention.prepare_graph_replay: a decode request of this batch "
                            "has more than 2 query tokens, a length beyond its pages or a page outside "
                            "the cache (FlashInfer's captured decode cannot skip it): run it eagerly");
    flashinfer(b.plan_slot).replan(q_start_.data(), kv_indptr_.data(), kv_len_.data(), b.num_decode);
  }

  // The decode requests' q_start, kv_len and kv_indptr (rows of the block
  // table) on the host, from the caller's host copies or the device's
  // values (the stream's work done); false when FlashInfer cannot take the
  // batch as it is.
  bool host_schedule(const MLABatch& b, const Tensor& cache, bool host) {
    const int B = b.num_decode;
    const int64_t max_pages = b.block_table.shape[1], stride = b.block_table.stride[0];
    const int64_t host_stride = host ? b.host_block_table.stride[0] : stride;
    q_start_.resize(B + 1);
    kv_len_.resize(B);
    kv_indptr_.resize(B);
    table_.resize(static_cast<size_t>(B) * host_stride);
    // Host copies by memcpy (a cudaMemcpy is not allowed inside a capture).
    auto fetch = [&](void* dst, const void* src, size_t bytes) {
      if (host)
        std::memcpy(dst, src, bytes);
      else
        MOELINK_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
    };
    fetch(q_start_.data(), host ? b.host_q_start.data : b.q_start.data, (B + 1) * 4);
    fetch(kv_len_.data(), host ? b.host_kv_len.data : b.kv_len.data, B * 4);
    if (B > 0) fetch(table_.data(), host ? b.host_block_table.data : b.block_table.data, table_.size() * 4);
    StepErrorRecord scratch{};
    const StepBounds bounds{q_start_[B], cache.shape[0], static_cast<int32_t>(max_pages),
                            static_cast<int32_t>(cache.shape[1])};
    if (q_start_[0] != 0) return false;
    for (int i = 0; i < B; ++i) {
      if (q_start_[i + 1] < q_start_[i] || q_start_[i + 1] - q_start_[i] > 2 ||
          !request_ok(i, q_start_.data(), kv_len_.data(), &table_[static_cast<size_t>(i) * host_stride], bounds,
                      &scratch))
        return false;
      kv_indptr_[i] = static_cast<int32_t>(i * stride);
    }
    return B > 0 && q_start_[B] > 0;
  }

  // The chunk's keys [k_pos0, k_pos0 + keys) against the query rows at
  // positions q_pos0 .. q_pos0 + q_rows - 1 on FlashInfer's kernel: the
  // calls prefill_calls() splits the chunk into, each call's output and LSE
  // folded into the running softmax.
  void flashinfer_prefill_chunk(const PrefillSoftmax& st, const Tensor& q, int64_t q_row0, int64_t q_rows,
                                int64_t q_pos0, const Tensor& kv, const Tensor& k_pe, int64_t k_pos0, int heads,
                                int nope_dims, int rope_dims, int v_dims, float scale, cudaStream_t stream) {
    const int64_t keys = kv.shape[0], head_dim = nope_dims + rope_dims;
    if (q_rows == 0 || keys == 0) return;
    auto* k = static_cast<uint16_t*>(prefill_keys_.get(static_cast<size_t>(keys) * heads * head_dim * 2));
    launch_assemble_keys(k, bf16_data(kv), kv.stride[0], bf16_data(k_pe), k_pe.stride[0], keys, heads, nope_dims,
                         rope_dims, v_dims, stream);
    const size_t o_bytes = static_cast<size_t>(q_rows) * heads * v_dims * 2;
    auto* o = static_cast<uint16_t*>(prefill_out_.get(o_bytes + static_cast<size_t>(q_rows) * heads * 4));
    auto* lse = reinterpret_cast<float*>(reinterpret_cast<char*>(o) + o_bytes);
    for (const PrefillCall& c : prefill_calls(q_pos0, q_rows, k_pos0, keys)) {
      if (c.rows == 0) continue;
      FlashInferPrefillArgs a{};
      a.q = bf16_data(q) + (q_row0 + c.row_first) * q.stride[0];
      a.q_stride_row = q.stride[0];
      a.q_stride_head = head_dim;
      a.k = k + (c.key_first - k_pos0) * heads * head_dim;
      a.k_stride_row = heads * head_dim;
      a.k_stride_head = head_dim;
      a.v = bf16_data(kv) + (c.key_first - k_pos0) * kv.stride[0] + nope_dims;
      a.v_stride_row = kv.stride[0];
      a.v_stride_head = nope_dims + v_dims;
      a.out = o;
      a.out_stride_row = static_cast<int64_t>(heads) * v_dims;
      a.out_stride_head = v_dims;
      a.lse = lse;
      a.q_rows = static_cast<int>(c.rows);
      a.keys = static_cast<int>(c.keys);
      a.heads = heads;
      a.scale = scale;
      a.causal = c.causal;
      flashinfer_prefill_->run(a, stream);
      launch_prefill_merge(st, c.row_first, o, lse, c.rows, stream);
    }
  }

  MLADecodeKernel kernel_;
  PooledCublas cublas_;  // the head GEMMs (MLAHeadGemm::kBf16)
  std::unique_ptr<FlashInferPrefill> flashinfer_prefill_;  // null: moelink's prefill kernel
  GrowingDeviceBuffer prefill_keys_, prefill_out_;        // FlashInfer's keys; one call's output and LSE
  // FlashInfer's decode (null in [0]: moelink's kernel), a plan and its
  // workspaces per MLABatch.plan_slot; slots past 0 made on first use.
  FlashInferMLA& flashinfer(int slot) {
    if (!flashinfer_[slot]) {
      RelaxedCaptureMode relaxed;  // a first use may come inside a capture
      flashinfer_[slot] = FlashInferMLA::create(local_heads_);
    }
    return *flashinfer_[slot];
  }
  std::unique_ptr<FlashInferMLA> flashinfer_[kMLAPlanSlots];
  // FlashMLA's decode (null in [0]: not for this attention), a workspace per
  // MLABatch.plan_slot (micro-batches may overlap on two streams).
  std::unique_ptr<FlashMLADecode> flashmla_[kMLAPlanSlots];
  int local_heads_ = 0;
  std::vector<int32_t> q_start_, kv_len_, kv_indptr_, table_;
  GrowingDeviceBuffer prefill_memory_;  // one request's running softmax at a time
  GrowingDeviceBuffer decode_workspace_;  // the tensor-core decode's split partials
};

}  // namespace

std::unique_ptr<AttentionOps> make_cuda_attention_ops(const MLAConfig& config, int local_heads,
                                                      const MLAOptions& options) {
  return std::make_unique<CudaAttentionOps>(config, local_heads, options);
}

}  // namespace moelink::detail::attention
