// moelink._C.TransferEngine and the KV-cache transfer (moelink/transfer_engine.h,
// moelink/kv_transfer.h): what a disaggregated-serving connector needs from
// Python, i.e. register host memory, exchange descriptors, write a request's
// KV pages and wait for them on the other side.
#pragma once

#include <nanobind/nanobind.h>

namespace moelink::python {

// Binds nothing (and sets with_fabric = False elsewhere) when moelink was
// built without libfabric.
void bind_fabric(nanobind::module_& m);

}  // namespace moelink::python
