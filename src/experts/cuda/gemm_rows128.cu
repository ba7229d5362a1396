// The prefill tile configuration: 128 x 128 x 128 tiles, two cooperative
// consumer warpgroups.
#include "experts/cuda/block_scaled_gemm_sm90.cuh"

namespace moelink::detail::experts {

std::unique_ptr<BlockScaledGemm> make_gemm_rows128(int groups) {
  using K = Sm90BlockScaledKernel<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                  cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  return std::make_unique<Sm90BlockScaledGemm<K>>(GemmTiles::kRows128, groups);
}

}  // namespace moelink::detail::experts
