// A build without CUDA: a Model on a GPU backend says so.
#include "model/model_ops.h"
#include "moelink/errors.h"

namespace moelink::detail::model {

std::unique_ptr<ModelOps> make_cuda_model_ops() {
  throw InvalidArgument(
      "moelink: Model: a GPU backend needs a build with CUDA (this one has none); use a host "
      "backend (cpu, internode-cpu) for the CPU path");
}

}  // namespace moelink::detail::model
