// Basic vocabulary of the public API: element types and strided tensor views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

// The C++ library never includes CUDA headers in its public API, so that a
// CPU-only build (and its users) need no CUDA toolkit. This is the same
// declaration cuda_runtime_api.h makes; C++ allows it twice.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace moelink {

enum class DType : uint8_t {
  kFloat8E4M3,  // fp8 e4m3 (OCP "fn": no infinities), 1 byte
  kBFloat16,
  kFloat16,
  kFloat32,
  kInt32,
  kUInt32,
  kInt64,
  kUInt8,  // raw bytes; accepted wherever fp8 e4m3 is expected
};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat8E4M3:
    case DType::kUInt8: return 1;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32:
    case DType::kUInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t);

// A non-owning view of a strided tensor of up to 3 dimensions. Strides are in
// elements, like torch's. `data == nullptr` means "no tensor" (e.g. no scales
// when tokens are not fp8). Memory is device memory for the NVLink backend and
// host memory for the CPU backend.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kUInt8;
  int ndim = 0;
  int64_t shape[3] = {0, 0, 0};
  int64_t stride[3] = {0, 0, 0};

  bool defined() const { return data != nullptr; }
  // Row-major contiguous view of `data` with the given shape (1 to 3 dims).
  static Tensor contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
};

}  // namespace moelink
