// moelink._C.MLAConfig / MLAAttention (moelink/attention.h) bound one to one;
// moelink/_attention.py adds config resolution, streams and defaults.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

void bind_attention(nanobind::module_& m);

}  // namespace moelink::python
