// Picks the CUTLASS kernel of a tile configuration (each compiled in its own
// translation unit: gemm_rows64.cu, gemm_rows128.cu).
#include "experts/cuda/block_scaled_gemm.h"

namespace moelink::detail::experts {

std::unique_ptr<BlockScaledGemm> make_gemm_rows64(int groups);
std::unique_ptr<BlockScaledGemm> make_gemm_rows128(int groups);

const char* gemm_tiles_name(GemmTiles t) {
  return t == GemmTiles::kRows64 ? "64x128x128 ping-pong" : "128x128x128 cooperative";
}

std::unique_ptr<BlockScaledGemm> make_block_scaled_gemm(GemmTiles tiles, int groups) {
  return tiles == GemmTiles::kRows64 ? make_gemm_rows64(groups) : make_gemm_rows128(groups);
}

}  // namespace moelink::detail::experts
