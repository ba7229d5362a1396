#include "nvlink/cuda_graph.h"

#include <string>

#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail {

std::unique_ptr<CapturedGraph> CapturedGraph::capture(cudaStream_t stream,
                                                      const std::function<void(cudaStream_t)>& record,
                                                      const char* what) {
  MOELINK_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  auto abandon = [stream] {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken) cudaGraphDestroy(broken);
    (void)cudaGetLastError();
  };
  try {
    record(stream);
  } catch (...) {
    abandon();
    throw;
  }
  std::unique_ptr<CapturedGraph> g(new CapturedGraph());
  const cudaError_t ended = cudaStreamEndCapture(stream, &g->graph_);
  if (ended != cudaSuccess) {
    (void)cudaGetLastError();
    throw_cuda_error(ended, (std::string("cudaStreamEndCapture (") + what + ")").c_str(), __FILE__, __LINE__);
  }
  const cudaError_t made = cudaGraphInstantiate(&g->exec_, g->graph_, 0);
  if (made != cudaSuccess) {
    (void)cudaGetLastError();
    throw_cuda_error(made, (std::string("cudaGraphInstantiate (") + what + ")").c_str(), __FILE__, __LINE__);
  }
  return g;
}

CapturedGraph::~CapturedGraph() {
  RelaxedCaptureMode relaxed;  // an owner may go while someone else captures
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
}

void CapturedGraph::launch(cudaStream_t stream) { MOELINK_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

}  // namespace moelink::detail
