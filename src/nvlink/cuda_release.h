// Releasing CUDA resources at any time, also while some other code of the
// process is capturing a CUDA graph.
//
// Engines capture graphs while other objects come and go: a moelink object
// that Python's garbage collector destroys in the middle of torch's capture
// calls cudaFree from the capturing thread. cudaFree, cudaEventDestroy,
// cudaStreamDestroy and the like count as "potentially unsafe" calls, which
// the default (global and thread-local) capture modes forbid: the call
// fails and invalidates the capture in progress. A thread in the relaxed
// capture mode may make them (what PyTorch's caching allocator does around
// its own cudaMalloc), so every release here runs in that mode; memory
// whose cudaFree is refused all the same is kept and freed by a later
// release, never leaked into the caller's error state.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

namespace moelink::detail {

// The calling thread's capture mode is relaxed while this lives.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&previous_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&previous_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

// cudaFree(p) for memory no work in flight uses any more (the caller's
// objects are destroyed after their streams' work). A refused free leaves
// no error behind (cudaGetLastError) and is retried by the next call.
inline void release_device_memory(void* p) {
  static std::mutex mu;
  static std::vector<void*> deferred;
  RelaxedCaptureMode relaxed;
  std::lock_guard<std::mutex> lock(mu);
  std::vector<void*> todo;
  todo.swap(deferred);
  if (p != nullptr) todo.push_back(p);
  for (void* q : todo) {
    if (cudaFree(q) != cudaSuccess) {
      (void)cudaGetLastError();
      deferred.push_back(q);
    }
  }
}

}  // namespace moelink::detail
