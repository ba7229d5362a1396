#include <algorithm>
// Device memory and CUDA-event timing for the NVLink backend. Every timed
// region is bracketed by two events on the one stream all work goes to, so a
// stamp pair measures the GPU time line, including any wait for peers.
#include <vector>

#include "cuda_check.h"
#include "numeric.h"
#include "platform.h"

namespace moelink_bench {

namespace {

class CudaTimer : public Timer {
 public:
  CudaTimer(cudaStream_t s, int iters, int stamps)
      : s_(s), stamps_(stamps), ev_(static_cast<size_t>(iters) * stamps) {
    for (auto& e : ev_) BENCH_CUDA(cudaEventCreate(&e));
  }
  ~CudaTimer() override {
    for (auto e : ev_) cudaEventDestroy(e);
  }
  void mark(int iter, int stamp) override {
    BENCH_CUDA(cudaEventRecord(ev_[static_cast<size_t>(iter) * stamps_ + stamp], s_));
  }
  void finish() override { BENCH_CUDA(cudaStreamSynchronize(s_)); }
  double elapsed_us(int iter, int from, int to) const override {
    const size_t b = static_cast<size_t>(iter) * stamps_;
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev_[b + from], ev_[b + to]));
    return ms * 1000.0;
  }

 private:
  cudaStream_t s_;
  int stamps_;
  std::vector<cudaEvent_t> ev_;
};

__global__ void empty_kernel() {}

// One warp per row; rows past the expert's count are skipped.
__global__ void identity_kernel(IdentityExperts e, size_t es) {
  const int j = blockIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= e.C || row >= e.counts[j]) return;
  const int64_t r = j * e.C + row;
  const auto* x = static_cast<const uint8_t*>(e.x) + r * e.H * es;
  for (int64_t h = threadIdx.x % 32; h < e.H; h += 32) {
    float s = e.S > 0 ? e.scales[r * e.S + scale_index(h, e.H, e.S)] : 1.0f;
    e.y[r * e.H + h] = float_to_bf16(load_token_elem(x, e.in_dtype, h) * s);
  }
}

class CudaPlatform : public Platform {
 public:
  explicit CudaPlatform(int device) {
    BENCH_CUDA(cudaSetDevice(device));
    BENCH_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~CudaPlatform() override {
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    cudaStreamDestroy(s_);
  }
  bool gpu() const override { return true; }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, bytes == 0 ? 256 : bytes));
    BENCH_CUDA(cudaMemsetAsync(p, 0, bytes, s_));
    BENCH_CUDA(cudaStreamSynchronize(s_));
    return p;
  }
  void release(void* p) override {
    cudaStreamSynchronize(s_);
    cudaFree(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s_));
    BENCH_CUDA(cudaStreamSynchronize(s_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s_));
    BENCH_CUDA(cudaStreamSynchronize(s_));
  }
  void zero(void* p, size_t bytes) override { BENCH_CUDA(cudaMemsetAsync(p, 0, bytes, s_)); }
  void sync() override { BENCH_CUDA(cudaStreamSynchronize(s_)); }
  cudaStream_t stream() const override { return s_; }
  double empty_kernel_us(int iters) override {
    CudaTimer timer(s_, iters, 2);
    for (int i = 0; i < iters; ++i) {
      timer.mark(i, 0);
      empty_kernel<<<1, 32, 0, s_>>>();
      timer.mark(i, 1);
    }
    timer.finish();
    std::vector<double> v(iters);
    for (int i = 0; i < iters; ++i) v[i] = timer.elapsed_us(i, 0, 1);
    std::nth_element(v.begin(), v.begin() + iters / 2, v.end());
    return v[iters / 2];
  }
  std::function<void()> capture(const std::function<void()>& work) override {
    cudaGraph_t graph = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    work();
    BENCH_CUDA(cudaStreamEndCapture(s_, &graph));
    cudaGraphExec_t exec = nullptr;
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_CUDA(cudaGraphDestroy(graph));
    graphs_.push_back(exec);
    cudaStream_t s = s_;
    return [exec, s] { BENCH_CUDA(cudaGraphLaunch(exec, s)); };
  }
  std::unique_ptr<Timer> make_timer(int iters, int stamps) override {
    return std::make_unique<CudaTimer>(s_, iters, stamps);
  }
  void identity_experts(const IdentityExperts& e) override {
    const int warps = 8;
    dim3 grid(static_cast<unsigned>((e.C + warps - 1) / warps), static_cast<unsigned>(e.L));
    identity_kernel<<<grid, warps * 32, 0, s_>>>(e, moelink::dtype_size(e.in_dtype));
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(s_));
  }

 private:
  std::vector<cudaGraphExec_t> graphs_;
  cudaStream_t s_ = nullptr;
};

}  // namespace

std::unique_ptr<Platform> make_cuda_platform(int device) {
  return std::make_unique<CudaPlatform>(device);
}

}  // namespace moelink_bench
