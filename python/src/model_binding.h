// moelink._C.ModelConfig and moelink._C.Model (moelink/model.h), bound one
// to one; moelink/_model.py adds config resolution, bootstraps and streams.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

void bind_model(nanobind::module_& m);

}  // namespace moelink::python
