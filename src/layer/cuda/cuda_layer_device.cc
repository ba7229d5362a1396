// LayerDevice on the current CUDA device: cudaMalloc'd memory, the gate GEMM
// through cuBLAS (bf16 tensor cores, or fp32, with fp32 accumulation), the
// small kernels of layer_kernels.cu.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "layer/cuda/layer_kernels.h"
#include "layer/layer_device.h"
#include "moelink/errors.h"
#include "nvlink/cublas_handles.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_graph.h"
#include "nvlink/cuda_memory.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail::layer {

struct LayerDevice::Graph {
  std::unique_ptr<CapturedGraph> captured;
};

namespace {

void cublas_ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw SystemError(std::string("moelink: MoELayer: ") + what + " failed: cuBLAS status " +
                      std::to_string(static_cast<int>(s)));
}

class CudaLayerDevice final : public CudaMemory<LayerDevice> {
 public:
  ~CudaLayerDevice() override {
    RelaxedCaptureMode relaxed;  // a layer may go while someone else captures
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (capture_stream_) cudaStreamDestroy(capture_stream_);
  }

  void gate_logits(float* logits, const Tensor& x, const void* gate, DType gate_dtype,
                   int num_experts, const int32_t*, float* x_f32, cudaStream_t stream) override {
    // All of x's rows (m is on the device): column-major, logits^T [E, rows]
    // = gate [H, E]^T . x^T [H, rows].
    const int64_t rows = x.shape[0], H = x.shape[1];
    if (rows == 0) return;
    cublas_ok(cublasSetStream(cublas_.get(), stream), "cublasSetStream");
    const float one = 1.0f, zero = 0.0f;
    if (gate_dtype == DType::kFloat32) {
      launch_bf16_to_f32(x_f32, static_cast<const uint16_t*>(x.data), x.stride[0], rows, H, stream);
      cublas_ok(cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, num_experts, static_cast<int>(rows),
                             static_cast<int>(H), &one, gate, CUDA_R_32F, static_cast<int>(H), x_f32,
                             CUDA_R_32F, static_cast<int>(H), &zero, logits, CUDA_R_32F, num_experts,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx (fp32 gate)");
    } else {
      cublas_ok(cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, num_experts, static_cast<int>(rows),
                             static_cast<int>(H), &one, gate, CUDA_R_16BF, static_cast<int>(H), x.data,
                             CUDA_R_16BF, static_cast<int>(x.stride[0]), &zero, logits, CUDA_R_32F,
                             num_experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx (bf16 gate)");
    }
  }

  void route(const float* logits, const float* bias, const RouterParams& p, const int32_t* bound_m,
             int64_t rows, int32_t* indices, float* weights, cudaStream_t stream) override {
    launch_router(logits, p.num_experts, bias, p, bound_m, rows, indices, p.top_k, weights, p.top_k,
                  stream);
  }

  void split_bound(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0, int32_t* m1,
                   cudaStream_t stream) override {
    launch_split_bound(bound_m, rows, half, m0, m1, stream);
  }

  void copy_rows(void* dst, int64_t dst_stride_bytes, const void* src, int64_t src_stride_bytes,
                 int64_t row_bytes, const int32_t* bound_m, int64_t rows, int32_t* bound_m_dst,
                 LayerErrorRecord* error, cudaStream_t stream) override {
    launch_copy_rows(dst, dst_stride_bytes, src, src_stride_bytes, row_bytes, bound_m, rows,
                     bound_m_dst, error, stream);
  }
  LayerErrorRecord take_error(LayerErrorRecord* record, cudaStream_t stream) override {
    return take_device_record(stream, record, [](const LayerErrorRecord&) { return true; });
  }

  std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>& record) override {
    if (capture_stream_ == nullptr)
      MOELINK_CUDA_CHECK(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
    auto g = std::make_shared<Graph>();
    g->captured = CapturedGraph::capture(capture_stream_, record, "the MoE layer's graph");
    return g;
  }
  void replay(Graph& g, cudaStream_t stream) override { g.captured->launch(stream); }

  void mark(int index, cudaStream_t stream) override {
    while (static_cast<int>(events_.size()) <= index) {
      cudaEvent_t e;
      MOELINK_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    MOELINK_CUDA_CHECK(cudaEventRecord(events_[index], stream));
  }
  double between(int first, int second) override {
    if (first < 0 || second >= static_cast<int>(events_.size())) return 0;
    MOELINK_CUDA_CHECK(cudaEventSynchronize(events_[second]));
    float ms = 0;
    MOELINK_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[first], events_[second]));
    return ms * 1e3;
  }
  void sync(cudaStream_t stream) override { MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream)); }

 private:
  std::vector<cudaEvent_t> events_;
  cudaStream_t capture_stream_ = nullptr;
  // Pooled, with a workspace of its own (nothing allocates inside a
  // capture) and never destroyed while another stream may capture.
  PooledCublas cublas_;
};

}  // namespace

std::unique_ptr<LayerDevice> make_cuda_layer_device() {
  return std::make_unique<CudaLayerDevice>();
}

}  // namespace moelink::detail::layer
