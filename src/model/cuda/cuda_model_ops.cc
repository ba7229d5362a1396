// ModelOps on the current CUDA device: cudaMalloc'd memory, the kernels of
// model_kernels.cu and lm_head on cuBLAS (bf16 inputs, fp32 accumulation
// and output), each step on the caller's stream.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>

#include "model/cuda/model_kernels.h"
#include "model/model_ops.h"
#include "nvlink/cublas_handles.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_memory.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail::model {

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

  void embed(const Tensor& h, const Tensor& token_ids, const uint16_t* table, int64_t vocab,
             const int32_t* rows, ModelErrorRecord* error, cudaStream_t stream) override {
    launch_embed(bf16_data(h), h.stride[0], h.shape[1], static_cast<const int32_t*>(token_ids.data),
                 token_ids.stride[0], table, vocab, rows, std::min(h.shape[0], token_ids.shape[0]), error,
                 stream);
  }

  void add_rms_norm(const Tensor& h, const Tensor& x, const Tensor& normed, const float* weight, float eps,
                    const int32_t* rows, cudaStream_t stream) override {
    launch_add_rms_norm(bf16_data(h), h.stride[0], x.defined() ? bf16_data(x) : nullptr,
                        x.defined() ? x.stride[0] : 0, normed.defined() ? bf16_data(normed) : nullptr,
                        normed.defined() ? normed.stride[0] : 0, h.shape[1], weight, eps, rows, h.shape[0],
                        stream);
  }

  void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
               const int32_t* rows, const int32_t* q_start, int num_requests, cudaStream_t stream) override {
    const int64_t D = h.shape[1];
    // Each request's last row, or every row in chunks (scoring): gathered,
    // one GEMM, and only the rows that exist copied out.
    const int64_t total = q_start ? num_requests : logits.shape[0];
    const int64_t chunk = q_start ? std::max<int64_t>(total, 1) : kRowsPerGemm;
    for (int64_t first = 0; first < total; first += chunk) {
      const int64_t k = std::min(chunk, total - first);
      auto* hs = static_cast<uint16_t*>(gathered_.get(static_cast<size_t>(k) * D * 2));
      auto* valid = static_cast<int32_t*>(valid_.get(static_cast<size_t>(k) * 4));
      auto* out = static_cast<float*>(logits_.get(static_cast<size_t>(k) * vocab * 4));
      launch_gather_rows(hs, bf16_data(h), h.stride[0], D, rows, q_start, first, k, valid, stream);
      // Column-major: out^T [V, k] = W [V, D] (W^T column-major) . hs^T [D, k].
      const float one = 1.0f, zero = 0.0f;
      PooledCublas::ok(cublasSetStream(cublas_.get(), stream), "cublasSetStream");
      PooledCublas::ok(cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(vocab),
                                    static_cast<int>(k), static_cast<int>(D), &one, weight, CUDA_R_16BF,
                                    static_cast<int>(D), hs, CUDA_R_16BF, static_cast<int>(D), &zero, out,
                                    CUDA_R_32F, static_cast<int>(vocab), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx (lm_head)");
      launch_copy_valid_rows(static_cast<float*>(logits.data) + first * logits.stride[0], logits.stride[0], out,
                             vocab, valid, k, stream);
    }
  }

  void sample(const Tensor& next_tokens, const Tensor& logits, const Tensor& temperature, const Tensor& top_k,
              const Tensor& top_p, const Tensor& seed, const int32_t* q_start, const int32_t* kv_len,
              int num_requests, ModelErrorRecord* error, cudaStream_t stream) override {
    SampleArgs a{};
    a.next_tokens = static_cast<int32_t*>(next_tokens.data);
    a.next_stride = next_tokens.ndim > 0 ? next_tokens.stride[0] : 1;
    a.logits = static_cast<const float*>(logits.data);
    a.logits_stride = logits.stride[0];
    a.vocab = logits.shape[1];
    a.temperature = temperature.defined() ? static_cast<const float*>(temperature.data) : nullptr;
    a.top_k = top_k.defined() ? static_cast<const int32_t*>(top_k.data) : nullptr;
    a.top_p = top_p.defined() ? static_cast<const float*>(top_p.data) : nullptr;
    a.seed = seed.defined() ? static_cast<const int64_t*>(seed.data) : nullptr;
    a.q_start = q_start;
    a.kv_len = kv_len;
    a.num_requests = num_requests;
    a.error = error;
    launch_sample(a, stream);
  }

  ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t stream) override {
    return take_device_record(stream, record, [](const ModelErrorRecord&) { return true; });
  }

 private:
  static constexpr int64_t kRowsPerGemm = 256;
  PooledCublas cublas_;
  GrowingDeviceBuffer gathered_, valid_, logits_;
};

}  // namespace

std::unique_ptr<ModelOps> make_cuda_model_ops() { return std::make_unique<CudaModelOps>(); }

}  // namespace moelink::detail::model
