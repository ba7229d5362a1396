// A build without FlashInfer's headers (MOELINK_FLASHINFER_DIR unset): the
// CUDA attention decodes with its own kernel.
#include "attention/cuda/flashinfer_mla.h"

namespace moelink::detail::attention {

bool FlashInferMLA::built() { return false; }
std::unique_ptr<FlashInferMLA> FlashInferMLA::create(int) { return nullptr; }

}  // namespace moelink::detail::attention
