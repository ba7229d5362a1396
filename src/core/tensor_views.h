// Views of a caller's tensor that the layer and the model hand to the
// public objects: a run of rows, and a matrix as the only expert of an
// Experts (a shared expert, a dense MLP).
#pragma once

#include <cstdint>

#include "moelink/types.h"

namespace moelink::detail {

// Rows [row0, row0 + rows) of a row-major matrix.
inline Tensor rows_of(const Tensor& t, int64_t row0, int64_t rows) {
  Tensor v = t;
  v.data = static_cast<char*>(t.data) + row0 * t.stride[0] * static_cast<int64_t>(dtype_size(t.dtype));
  v.shape[0] = rows;
  return v;
}

// A [rows, cols] tensor viewed as [1, rows, cols].
inline Tensor as_single_expert(const Tensor& t) {
  Tensor v = t;
  v.ndim = 3;
  v.shape[2] = t.shape[1];
  v.shape[1] = t.shape[0];
  v.shape[0] = 1;
  v.stride[2] = t.stride[1];
  v.stride[1] = t.stride[0];
  v.stride[0] = t.shape[0] * t.stride[0];
  return v;
}

}  // namespace moelink::detail
