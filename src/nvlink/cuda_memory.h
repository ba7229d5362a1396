// DeviceMemory on the current CUDA device (core/device_memory.h's
// HostMemory for the GPU): zeroed cudaMalloc'd memory, released safely
// while another stream may capture (cuda_release.h), synchronous copies.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

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

// Device memory that grows to the largest size asked for. What it outgrows
// stays allocated until it goes: a CUDA graph captured on an earlier,
// smaller call keeps those addresses (the model's decode graphs of small
// batches, replayed after a larger step grew a buffer, wrote freed memory:
// an illegal address on an H100). It grows to twice its capacity at least,
// so what it keeps stays below what it holds; growing allocates (not inside
// a capture in the global mode) but never waits for the device.
class GrowingDeviceBuffer {
 public:
  GrowingDeviceBuffer() = default;
  GrowingDeviceBuffer(const GrowingDeviceBuffer&) = delete;
  GrowingDeviceBuffer& operator=(const GrowingDeviceBuffer&) = delete;
  ~GrowingDeviceBuffer() {
    for (void* p : outgrown_) release_device_memory(p);
    release_device_memory(p_);
  }
  // Memory of `bytes` at least.
  void* get(size_t bytes) {
    if (bytes > capacity_) {
      const size_t grown = std::max(bytes, 2 * capacity_);
      outgrown_.reserve(outgrown_.size() + 1);  // no throw once allocated
      void* p = nullptr;
      MOELINK_CUDA_CHECK(cudaMalloc(&p, grown));
      if (p_ != nullptr) outgrown_.push_back(p_);
      p_ = p;
      capacity_ = grown;
    }
    asked_ = std::max(asked_, bytes);
    return p_;
  }
  void* data() const { return p_; }
  // The largest size asked for (what callers may use; the allocation may be larger).
  size_t bytes() const { return asked_; }

 private:
  void* p_ = nullptr;
  size_t capacity_ = 0, asked_ = 0;
  std::vector<void*> outgrown_;  // perhaps still in a captured graph
};

}  // namespace moelink::detail
