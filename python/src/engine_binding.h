// moelink._C.Engine: the serving engine's step loop (src/engine/engine.h)
// over a Model and its own KvCacheManager; moelink/_engine.py wraps it.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

// Binds the Engine where the build has it (xxHash found), else nothing.
void bind_engine(nanobind::module_& m);

}  // namespace moelink::python
