// The split-K GEMM on 128 x 128 row tiles (gemm_tile_configs.cuh's
// SplitKRows128Kernel) in its own translation unit: a CUTLASS kernel takes
// about a minute to compile, in parallel with the others.
#include "experts/cuda/gemm_tile_configs.cuh"

namespace moelink::detail::experts {

std::unique_ptr<BlockScaledGemm> make_split_k_rows128_gemm(int groups, GemmGrid grid) {
  return std::make_unique<Sm90BlockScaledGemm<SplitKRows128Kernel>>(GemmTiles::kRows128, groups, grid);
}

}  // namespace moelink::detail::experts
