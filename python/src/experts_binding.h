// moelink._C.Experts: the expert kernels (moelink/experts.h) bound one to
// one; moelink/_experts.py adds streams and defaults.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

void bind_experts(nanobind::module_& m);

}  // namespace moelink::python
