// DLPack / buffer-protocol objects (torch, numpy, cupy, jax...) to
// moelink::Tensor views, with the argument name in every error.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "moelink/types.h"

namespace moelink::python {

namespace nb = nanobind;

// Where the tensors of one call must live.
enum class Place {
  kHost,  // CPU memory (or pinned host memory): the CPU backend
  kCuda,  // CUDA device memory of device `device_id`: the NVLink backend
  kAny,   // either (weights copied in by MoELayer.set_weights)
};

// Keeps the imported arrays (and any temporary views made for fp8/bf16 numpy
// or torch tensors) alive for the duration of one call.
struct Holder {
  std::vector<nb::ndarray<nb::ro>> ro;  // inputs
  std::vector<nb::ndarray<>> rw;        // outputs
  std::vector<nb::object> views;
};

struct ConvertContext {
  std::string call;  // "dispatch" / "combine"
  Place place = Place::kHost;
  int device_id = 0;  // for kCuda; < 0: any
  Holder holder;
};

// Converts `obj` (argument `name`) to a Tensor. None gives an undefined
// Tensor when `optional`; otherwise it is an error. Throws
// moelink::InvalidArgument (ValueError in Python) for a wrong device, an
// unsupported dtype or more than 3 dimensions, nb::type_error for an object
// that is not an array at all.
Tensor to_tensor(ConvertContext& ctx, nb::handle obj, const char* name, bool writable,
                 bool optional = false);

// The calling thread's CUDA device (SystemError when CUDA cannot say); -1 in
// a build without CUDA.
int current_cuda_device();

// DType from a DLPack dtype; false when moelink has no such type.
bool dtype_from_dlpack(const nb::dlpack::dtype& dt, DType* out);

}  // namespace moelink::python
