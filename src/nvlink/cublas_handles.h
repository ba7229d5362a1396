// cuBLAS handles that outlive their users, so that no cublasDestroy runs
// while some other code of the process captures a CUDA graph.
//
// cublasDestroy synchronizes the device, which invalidates any capture in
// progress in every capture mode, the relaxed one included (measured on an
// H200 with CUDA 13.0: cudaFree, cudaGraphDestroy and cudaStreamDestroy are
// safe in the relaxed mode, cublasDestroy is not). A user of cuBLAS takes a
// handle with its workspace from this pool and gives both back when it goes;
// the next user of the same device takes them again. Handles and
// workspaces stay until the process exits.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "moelink/errors.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail {

class PooledCublas {
 public:
  // Workspace bytes of every pooled handle: cuBLAS then allocates nothing
  // inside a capture.
  static constexpr size_t kWorkspaceBytes = 32 << 20;

  // A handle of the current device, with its workspace set.
  PooledCublas() {
    MOELINK_CUDA_CHECK(cudaGetDevice(&entry_.device));
    {
      std::lock_guard<std::mutex> lock(mu());
      auto& free_list = pool();
      for (size_t i = 0; i < free_list.size(); ++i)
        if (free_list[i].device == entry_.device) {
          entry_ = free_list[i];
          free_list.erase(free_list.begin() + static_cast<std::ptrdiff_t>(i));
          return;
        }
    }
    ok(cublasCreate(&entry_.handle), "cublasCreate");
    const cudaError_t e = cudaMalloc(&entry_.workspace, kWorkspaceBytes);
    if (e != cudaSuccess) {
      cublasDestroy(entry_.handle);
      MOELINK_CUDA_CHECK(e);
    }
    ok(cublasSetWorkspace(entry_.handle, entry_.workspace, kWorkspaceBytes), "cublasSetWorkspace");
  }
  ~PooledCublas() {
    std::lock_guard<std::mutex> lock(mu());
    pool().push_back(entry_);
  }
  PooledCublas(const PooledCublas&) = delete;
  PooledCublas& operator=(const PooledCublas&) = delete;

  cublasHandle_t get() const { return entry_.handle; }

  static void ok(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS)
      throw SystemError(std::string("moelink: ") + what + " failed: cuBLAS status " +
                        std::to_string(static_cast<int>(s)));
  }

 private:
  struct Entry {
    int device = -1;
    cublasHandle_t handle = nullptr;
    void* workspace = nullptr;
  };
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  // Never destroyed: handles may still be given back during static
  // destruction, and the driver reclaims everything at exit.
  static std::vector<Entry>& pool() {
    static auto* p = new std::vector<Entry>();
    return *p;
  }
  Entry entry_;
};

}  // namespace moelink::detail
