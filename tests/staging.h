// Host vectors staged into the memory an object under test runs on: in
// place for the CPU paths, copies in a GPU's memory (and back) for CUDA.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "all_to_all_cases.h"  // MemoryOps
#if defined(MOELINK_WITH_CUDA)
#include "gpu_memory_ops.h"
#endif

namespace moelink_test {

class Staging {
 public:
  explicit Staging(MemoryOps* gpu) : gpu_(gpu) {}  // null: host memory, used in place
  ~Staging() {
    for (void* p : copies_) gpu_->free(p);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  template <class T>
  T* put(std::vector<T>& v) {
    if (gpu_ == nullptr) return v.data();
    void* p = gpu_->alloc(std::max<size_t>(v.size(), 1) * sizeof(T));
    if (!v.empty()) gpu_->h2d(p, v.data(), v.size() * sizeof(T));
    copies_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  void get(std::vector<T>& v, const T* staged) {
    if (gpu_ != nullptr && !v.empty()) gpu_->d2h(v.data(), staged, v.size() * sizeof(T));
  }

 private:
  MemoryOps* gpu_;
  std::vector<void*> copies_;
};

// GPU 0's memory when `gpu`, else null (host memory).
inline std::unique_ptr<MemoryOps> gpu_memory_if(bool gpu) {
#if defined(MOELINK_WITH_CUDA)
  if (gpu) return std::make_unique<GpuMemoryOps>(0);
#endif
  (void)gpu;
  return nullptr;
}

}  // namespace moelink_test
