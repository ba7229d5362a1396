// A build without FlashMLA's source (MOELINK_FLASHMLA_DIR unset): the CUDA
// attention decodes on FlashInfer's kernel or its own.
#include "attention/cuda/flashmla_decode.h"

namespace moelink::detail::attention {

bool FlashMLADecode::built() { return false; }
int FlashMLADecode::sm_parts(int) { return 1; }
std::unique_ptr<FlashMLADecode> FlashMLADecode::create(int) { return nullptr; }

}  // namespace moelink::detail::attention
