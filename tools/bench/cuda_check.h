// Error checks for CUDA and NCCL calls: throw with the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define BENCH_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess)                                                              \
      throw std::runtime_error(std::string(#call) + " failed at " + __FILE__ + ":" +      \
                               std::to_string(__LINE__) + ": " + cudaGetErrorString(err_)); \
  } while (0)

#define BENCH_NCCL(call)                                                                  \
  do {                                                                                    \
    ncclResult_t res_ = (call);                                                           \
    if (res_ != ncclSuccess)                                                              \
      throw std::runtime_error(std::string(#call) + " failed at " + __FILE__ + ":" +      \
                               std::to_string(__LINE__) + ": " + ncclGetErrorString(res_)); \
  } while (0)
