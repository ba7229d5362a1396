// One executable CUDA graph captured from what a callback issues on a
// stream: the MoE layer's per-bucket graphs and the model's decode steps.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>

namespace moelink::detail {

class CapturedGraph {
 public:
  // Captures (thread-local mode) what `record` issues on `stream` and
  // instantiates it. A capture that fails (record throws, or CUDA
  // invalidated it) is ended and its error taken off the runtime's
  // last-error slot, so that the next call starts on a clean stream; then
  // throws (CudaError naming `what`, or what record threw).
  static std::unique_ptr<CapturedGraph> capture(cudaStream_t stream,
                                                const std::function<void(cudaStream_t)>& record,
                                                const char* what);
  ~CapturedGraph();  // safe while another stream captures
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream);

 private:
  CapturedGraph() = default;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moelink::detail
