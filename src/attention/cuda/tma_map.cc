// cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion, for the
// decode kernels' TMA copies (tma_map.h).
#include "attention/cuda/tma_map.h"

#include <cuda_runtime_api.h>

#include <string>

#include "moelink/errors.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    MOELINK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                                        &found));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw SystemError("moelink: attention: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12)");
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap bf16_swizzled_row_map(const void* base, uint64_t cols, uint64_t rows, uint64_t row_bytes,
                                  uint32_t box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};  // bytes, of every dimension past the first
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult rc =
      encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                     element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS)
    throw SystemError("moelink: attention: cuTensorMapEncodeTiled refused a map of " + std::to_string(rows) +
                      " rows x " + std::to_string(cols) + " bf16 (row stride " + std::to_string(row_bytes) +
                      " bytes, box 64 x " + std::to_string(box_rows) + ", base " +
                      std::to_string(reinterpret_cast<uintptr_t>(base)) + "): CUresult " +
                      std::to_string(static_cast<int>(rc)));
  return map;
}

}  // namespace moelink::detail::attention
