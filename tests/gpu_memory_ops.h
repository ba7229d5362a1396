// Device memory on one GPU for the shared all-to-all driver
// (all_to_all_cases.h): the MemoryOps of every GPU backend's tests.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "all_to_all_cases.h"

namespace moelink_test {

// Throws std::runtime_error naming the call when a CUDA call fails.
void cuda_ok(cudaError_t e, const char* what);
#define CUDA_OK(call) ::moelink_test::cuda_ok((call), #call)

// Device memory on one GPU, one non-blocking stream. Copies are synchronous
// from the caller's point of view.
class GpuMemoryOps : public MemoryOps {
 public:
  explicit GpuMemoryOps(int device) {
    CUDA_OK(cudaSetDevice(device));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_OK(cudaMalloc(&scratch_, kScratchBytes));
  }
  ~GpuMemoryOps() override {
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    return p;
  }
  void free(void* p) override { cudaFree(p); }
  void h2d(void* dst, const void* src, size_t bytes) override {
    CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    sync();
  }
  void d2h(void* dst, const void* src, size_t bytes) override {
    CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    sync();
  }
  void fill(void* dst, uint8_t byte, size_t bytes) override {
    CUDA_OK(cudaMemsetAsync(dst, byte, bytes, stream_));
    sync();
  }
  cudaStream_t stream() override { return stream_; }
  void sync() override { CUDA_OK(cudaStreamSynchronize(stream_)); }
  // Unrelated device work queued between the halves (capturable).
  void other_work() override {
    CUDA_OK(cudaMemsetAsync(scratch_, ++calls_ & 0xFF, kScratchBytes, stream_));
  }

 private:
  static constexpr size_t kScratchBytes = 8 << 20;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  int calls_ = 0;
};

}  // namespace moelink_test
