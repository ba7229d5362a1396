// ModelOps on the current CUDA device: cudaMalloc'd memory, the kernels of
// model_kernels.cu and lm_head on cuBLAS (bf16 inputs, fp32 accumulation
// and output), each step on the caller's stream.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>

#include "model/cuda/model_kernels.h"
#include "model/model_ops.h"
#include "nvlink/cublas_handles.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_graph.h"
#include "nvlink/error_record_batch.h"
#include "nvlink/cuda_memory.h"
#include "nvlink/cuda_release.h"
#include "nvlink/rms_norm.h"

namespace moelink::detail::model {

struct ModelOps::Graph {
  std::unique_ptr<CapturedGraph> captured;
};

namespace {

uint16_t* bf16_data(const Tensor& t) { return static_cast<uint16_t*>(t.data); }

class CudaModelOps final : public CudaMemory<ModelOps> {
 public:
  void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    if (bytes > 0) MOELINK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  }
  void sync(cudaStream_t stream) override { MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream)); }

  void step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows,
                 cudaStream_t stream) override {
    launch_step_rows(q_start, num_requests, n, rows, stream);
  }
  void rebase_offsets(int32_t* dst, const int32_t* src, int first, int count, cudaStream_t stream) override {
    launch_rebase_offsets(dst, src, first, count, stream);
  }

  void move_rows(const Tensor& part, const Tensor& whole, const int32_t* first, const int32_t* count,
                 bool into_part, cudaStream_t stream) override {
    launch_move_rows(bf16_data(part), part.stride[0], part.shape[0], bf16_data(whole), whole.stride[0],
                     part.shape[1], first, count, into_part, stream);
  }

  void embed(const Tensor& h, const Tensor& token_ids, const uint16_t* table, int64_t vocab,
             const int32_t* rows, ModelErrorRecord* error, cudaStream_t stream) override {
    launch_embed(bf16_data(h), h.stride[0], h.shape[1], static_cast<const int32_t*>(token_ids.data),
                 token_ids.stride[0], table, vocab, rows, std::min(h.shape[0], token_ids.shape[0]), error,
                 stream);
  }

  void add_rms_norm(const Tensor& h, const Tensor& x, const Tensor& normed, const float* weight, float eps,
                    const int32_t* rows, cudaStream_t stream) override {
    launch_residual_rms_norm(bf16_data(h), h.stride[0], x.defined() ? bf16_data(x) : nullptr,
                             x.defined() ? x.stride[0] : 0, bf16_data(h), h.stride[0],
                             normed.defined() ? bf16_data(normed) : nullptr, normed.defined() ? normed.stride[0] : 0,
                             h.shape[1], weight, eps, rows, h.shape[0], stream);
  }

  void linear(const Tensor& out, const Tensor& x, const uint16_t* weight, const int32_t*,
              cudaStream_t stream) override {
    // Every row the tensors hold (the device-read bound only trims work
    // the rows past it would waste): out^T [N, m] = W [N, K] . x^T [K, m].
    const int64_t m = x.shape[0], N = out.shape[1], K = x.shape[1];
    if (m == 0) return;
    gemm(stream, N, m, K, weight, K, x.data, x.stride[0], out.data, CUDA_R_16BF, out.stride[0], "linear");
  }

  void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
               const int32_t* rows, const int32_t* row_index, cudaStream_t stream) override {
    const int64_t D = h.shape[1];
    // The rows asked for, or every row in chunks (scoring): gathered, one
    // GEMM, and only the rows that exist copied out.
    const int64_t total = logits.shape[0];
    const int64_t chunk = row_index ? std::max<int64_t>(total, 1) : kRowsPerGemm;
    for (int64_t first = 0; first < total; first += chunk) {
      const int64_t k = std::min(chunk, total - first);
      auto* hs = static_cast<uint16_t*>(gathered_.get(static_cast<size_t>(k) * D * 2));
      auto* valid = static_cast<int32_t*>(valid_.get(static_cast<size_t>(k) * 4));
      auto* out = static_cast<float*>(logits_.get(static_cast<size_t>(k) * vocab * 4));
      launch_gather_rows(hs, bf16_data(h), h.stride[0], D, rows, row_index, first, k, valid, stream);
      gemm(stream, vocab, k, D, weight, D, hs, D, out, CUDA_R_32F, vocab, "lm_head");
      launch_copy_valid_rows(static_cast<float*>(logits.data) + first * logits.stride[0], logits.stride[0], out,
                             vocab, valid, k, stream);
    }
  }

  void plan_samples(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts, int num_requests,
                    int slots, const int32_t* rows, int32_t* row_index, int32_t* position, ModelErrorRecord* error,
                    cudaStream_t stream) override {
    launch_plan_samples(q_start, kv_len, num_drafts, num_requests, slots, rows, row_index, position, error, stream);
  }

  void sample(const Tensor& tokens, const Tensor& logits, const Tensor& temperature, const Tensor& top_k,
              const Tensor& top_p, const Tensor& seed, const int32_t* row_index, const int32_t* position,
              int slots, ModelErrorRecord* error, cudaStream_t stream) override {
    SampleArgs a{};
    a.tokens = static_cast<int32_t*>(tokens.data);
    a.tokens_stride = tokens.ndim > 0 ? tokens.stride[0] : 1;
    a.logits = static_cast<const float*>(logits.data);
    a.logits_stride = logits.stride[0];
    a.vocab = logits.shape[1];
    a.temperature = temperature.defined() ? static_cast<const float*>(temperature.data) : nullptr;
    a.top_k = top_k.defined() ? static_cast<const int32_t*>(top_k.data) : nullptr;
    a.top_p = top_p.defined() ? static_cast<const float*>(top_p.data) : nullptr;
    a.seed = seed.defined() ? static_cast<const int64_t*>(seed.data) : nullptr;
    a.row_index = row_index;
    a.position = position;
    a.slots = tokens.shape[0];
    a.slots_per_request = slots;
    a.error = error;
    launch_sample(a, stream);
  }

  void accept_drafts(const int32_t* samples, const int32_t* row_index, int slots, const Tensor& token_ids,
                     const int32_t* q_start, const int32_t* known_next, int num_requests, int32_t* next_tokens,
                     int64_t next_stride, int32_t* accepted, int32_t* mtp_tokens, int32_t* draft_row,
                     cudaStream_t stream) override {
    AcceptArgs a{};
    a.samples = samples;
    a.row_index = row_index;
    a.slots = slots;
    a.ids = static_cast<const int32_t*>(token_ids.data);
    a.ids_stride = token_ids.defined() ? token_ids.stride[0] : 1;
    a.q_start = q_start;
    a.known_next = known_next;
    a.num_requests = num_requests;
    a.next_tokens = next_tokens;
    a.next_stride = next_stride;
    a.accepted = accepted;
    a.mtp_tokens = mtp_tokens;
    a.draft_row = draft_row;
    launch_accept_drafts(a, stream);
  }

  ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t stream) override {
    return take_device_record(stream, record, [](const ModelErrorRecord&) { return true; });
  }
  void run_check(cudaStream_t stream, const std::function<void()>& check) override {
    records_.run(stream, check);
  }

  std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>& record) override {
    // Its own stream: callers on the legacy default stream get graphs too.
    if (capture_stream_ == nullptr)
      MOELINK_CUDA_CHECK(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
    auto g = std::make_shared<Graph>();
    g->captured = CapturedGraph::capture(capture_stream_, record, "the model's decode step");
    return g;
  }
  void replay(Graph& g, cudaStream_t stream) override { g.captured->launch(stream); }

  ~CudaModelOps() override {
    RelaxedCaptureMode relaxed;  // a model may go while someone else captures
    if (capture_stream_) cudaStreamDestroy(capture_stream_);
  }

 private:
  // Column-major C [M, N] = A^T . B with A [K, M] (the weight, row-major
  // [M, K]) and B [K, N] (rows of activations): bf16 inputs, fp32
  // accumulation, C in c_type.
  void gemm(cudaStream_t stream, int64_t M, int64_t N, int64_t K, const void* a, int64_t lda, const void* b,
            int64_t ldb, void* c, cudaDataType_t c_type, int64_t ldc, const char* what) {
    const float one = 1.0f, zero = 0.0f;
    PooledCublas::ok(cublasSetStream(cublas_.get(), stream), "cublasSetStream");
    PooledCublas::ok(cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(M), static_cast<int>(N),
                                  static_cast<int>(K), &one, a, CUDA_R_16BF, static_cast<int>(lda), b, CUDA_R_16BF,
                                  static_cast<int>(ldb), &zero, c, c_type, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     (std::string("cublasGemmEx (") + what + ")").c_str());
  }

  static constexpr int64_t kRowsPerGemm = 256;
  cudaStream_t capture_stream_ = nullptr;
  PooledCublas cublas_;
  GrowingDeviceBuffer gathered_, valid_, logits_;
  RecordBatch records_;  // the step's error records, read in one copy (run_check)
};

}  // namespace

std::unique_ptr<ModelOps> make_cuda_model_ops() { return std::make_unique<CudaModelOps>(); }

}  // namespace moelink::detail::model
