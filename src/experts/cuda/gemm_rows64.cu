// The decode tile configuration: 64 x 128 x 128 tiles, ping-pong consumer
// warpgroups (one tile each, so one's epilogue overlaps the other's
// mainloop).
#include "experts/cuda/block_scaled_gemm_sm90.cuh"

namespace moelink::detail::experts {

std::unique_ptr<BlockScaledGemm> make_gemm_rows64(int groups) {
  using K = Sm90BlockScaledKernel<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                  cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
  return std::make_unique<Sm90BlockScaledGemm<K>>(GemmTiles::kRows64, groups);
}

}  // namespace moelink::detail::experts
