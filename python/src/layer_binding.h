// moelink._C.MoEModelConfig and moelink._C.MoELayer (moelink/moe_layer.h),
// bound one to one; moelink/_moe_layer.py adds defaults and streams.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

void bind_moe_layer(nanobind::module_& m);

}  // namespace moelink::python
