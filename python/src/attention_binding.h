// moelink._C.MLAConfig / MLAAttention (moelink/attention.h) bound one to one;
// moelink/_attention.py adds config resolution, streams and defaults.
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <type_traits>

#include "moelink/attention.h"
#include "moelink/errors.h"

namespace moelink::python {

void bind_attention(nanobind::module_& m);

// MLAOptions.decode_kernel / prefill_kernel from their names (the two
// enums share three; the decode has "flashmla" too); `owner` names the
// class in the error (MLAAttention, Model).
template <class Kernel>
Kernel parse_kernel(const char* owner, const char* field, const std::string& s) {
  constexpr bool decode = std::is_same_v<Kernel, MLADecodeKernel>;
  if (s == "auto") return Kernel::kAuto;
  if (s == "flashinfer") return Kernel::kFlashInfer;
  if (s == "moelink") return Kernel::kMoelink;
  if constexpr (decode)
    if (s == "flashmla") return Kernel::kFlashMLA;
  throw InvalidArgument(std::string("moelink: ") + owner + ": " + field + " = '" + s + "' must be 'auto', " +
                        (decode ? "'flashinfer', 'flashmla' or 'moelink'" : "'flashinfer' or 'moelink'"));
}

// MLAOptions.head_gemm from its name.
inline MLAHeadGemm parse_head_gemm(const char* owner, const std::string& s) {
  if (s == "bf16") return MLAHeadGemm::kBf16;
  if (s == "fp8") return MLAHeadGemm::kFp8;
  throw InvalidArgument(std::string("moelink: ") + owner + ": head_gemm = '" + s + "' must be 'bf16' or 'fp8'");
}

}  // namespace moelink::python
