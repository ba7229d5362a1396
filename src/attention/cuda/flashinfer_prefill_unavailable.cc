// A build without FlashInfer's headers (MOELINK_FLASHINFER_DIR unset): the
// CUDA attention's prefill runs moelink's own kernel.
#include "attention/cuda/flashinfer_prefill.h"

namespace moelink::detail::attention {

bool FlashInferPrefill::built() { return false; }
std::unique_ptr<FlashInferPrefill> FlashInferPrefill::create() { return nullptr; }

}  // namespace moelink::detail::attention
