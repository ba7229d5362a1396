// CUDA error checks for host code: every runtime call's status is checked
// and turned into a SystemError naming the call and where it was made.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "moelink/errors.h"

namespace moelink::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw SystemError(std::string("moelink: CUDA error in ") + what + " (" + file + ":" +
                    std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                    cudaGetErrorString(err));
}

}  // namespace moelink::detail

#define MOELINK_CUDA_CHECK(call)                                                     \
  do {                                                                               \
    cudaError_t moelink_err_ = (call);                                               \
    if (moelink_err_ != cudaSuccess)                                                 \
      ::moelink::detail::throw_cuda_error(moelink_err_, #call, __FILE__, __LINE__);  \
  } while (0)
