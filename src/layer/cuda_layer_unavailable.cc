// A build without CUDA: the GPU backends' MoELayer says so.
#include "layer/layer_device.h"
#include "moelink/errors.h"

namespace moelink::detail::layer {

std::unique_ptr<LayerDevice> make_cuda_layer_device() {
  throw InvalidArgument("moelink: MoELayer: a GPU backend needs a build with CUDA; use the cpu or "
                        "internode-cpu backend");
}

}  // namespace moelink::detail::layer
