#include "gpu_memory_ops.h"

namespace moelink_test {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
}

}  // namespace moelink_test
