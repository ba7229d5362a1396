// moelink._C.MoEModelConfig and moelink._C.MoELayer (moelink/moe_layer.h),
// bound one to one; moelink/_moe_layer.py adds defaults and streams.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "moelink/moe_layer.h"

namespace moelink::python {

void bind_moe_layer(nanobind::module_& m);

// MoELayerOptions from the Python arguments (backend and overlap by name),
// shared by MoELayer and Model.
MoELayerOptions moe_layer_options(int64_t max_tokens, const std::string& backend,
                                  const std::string& overlap, int64_t micro_batch_min_tokens,
                                  bool cuda_graphs, int dp_size, double timeout_s, int debug,
                                  int profile);

}  // namespace moelink::python
