// DeviceMemory on the current CUDA device (core/device_memory.h's
// HostMemory for the GPU): zeroed cudaMalloc'd memory, released safely
// while another stream may capture (cuda_release.h), synchronous copies.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail {

template <class Base>
class CudaMemory : public Base {
 public:
  bool host_memory() const override { return false; }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    MOELINK_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    MOELINK_CUDA_CHECK(cudaMemset(p, 0, bytes > 0 ? bytes : 1));
    return p;
  }
  void free(void* p) override { release_device_memory(p); }
  void copy_in(void* dst, const void* src, size_t bytes) override {
    MOELINK_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  void copy_out(void* dst, const void* src, size_t bytes) override {
    MOELINK_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
};

// Device memory that grows to the largest size asked for. Growing waits
// for the device (eager steps only), so nothing in flight still uses the
// old memory.
class GrowingDeviceBuffer {
 public:
  GrowingDeviceBuffer() = default;
  GrowingDeviceBuffer(const GrowingDeviceBuffer&) = delete;
  GrowingDeviceBuffer& operator=(const GrowingDeviceBuffer&) = delete;
  ~GrowingDeviceBuffer() { release_device_memory(p_); }
  void* get(size_t bytes) {
    if (bytes > bytes_) {
      MOELINK_CUDA_CHECK(cudaDeviceSynchronize());
      release_device_memory(p_);
      p_ = nullptr;
      bytes_ = 0;
      MOELINK_CUDA_CHECK(cudaMalloc(&p_, bytes));
      bytes_ = bytes;
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace moelink::detail
