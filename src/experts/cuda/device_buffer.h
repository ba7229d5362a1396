// Owned device memory (cudaMalloc / cudaFree), so that a constructor that
// throws half-way frees what it had allocated; freed in a way that is legal
// during another stream's graph capture (nvlink/cuda_release.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail::experts {

struct CudaFree {
  void operator()(void* p) const { release_device_memory(p); }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;

inline DeviceBuffer device_alloc(size_t bytes, bool zero = false) {
  void* p = nullptr;
  MOELINK_CUDA_CHECK(cudaMalloc(&p, bytes));
  DeviceBuffer b(p);
  if (zero) MOELINK_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return b;
}

}  // namespace moelink::detail::experts
