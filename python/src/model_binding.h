// moelink._C.ModelConfig and moelink._C.Model (moelink/model.h), bound one
// to one; moelink/_model.py adds config resolution, bootstraps and streams.
#pragma once

#include <nanobind/nanobind.h>

#include "moelink/model.h"

namespace moelink::python {

void bind_model(nanobind::module_& m);

// The moelink::Model inside a moelink._C.Model (TypeError for anything else).
Model& unwrap_model(nanobind::handle model);

}  // namespace moelink::python
