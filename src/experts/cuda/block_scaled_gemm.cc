// Names of the tile configurations and the factory that picks one's CUTLASS
// kernel (each compiled in its own generated translation unit).
#include "experts/cuda/block_scaled_gemm.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "moelink/errors.h"

namespace moelink::detail::experts {

#define MOELINK_DECLARE(name) std::unique_ptr<BlockScaledGemm> make_gemm_##name(int groups, GemmGrid grid);
MOELINK_DECLARE(kSwap128N32)
MOELINK_DECLARE(kRows64)
MOELINK_DECLARE(kRows128)
MOELINK_DECLARE(kRows128C2)
#if defined(MOELINK_EXPERTS_TILE_SWEEP)
MOELINK_DECLARE(kRows64Plain)
MOELINK_DECLARE(kRows128Plain)
#endif
#undef MOELINK_DECLARE

const char* gemm_tiles_name(GemmTiles t) {
  switch (t) {
    case GemmTiles::kRows64: return "rows64";
    case GemmTiles::kRows128: return "rows128";
    case GemmTiles::kSwap128N32: return "swap128n32";
    case GemmTiles::kRows64Plain: return "rows64plain";
    case GemmTiles::kRows128Plain: return "rows128plain";
    case GemmTiles::kRows128C2: return "rows128c2";
  }
  return "?";
}

bool gemm_tiles_from_name(const char* name, GemmTiles* out) {
  for (GemmTiles t : kAllGemmTiles)
    if (std::strcmp(name, gemm_tiles_name(t)) == 0) {
      *out = t;
      return true;
    }
  return false;
}

bool gemm_tiles_built(GemmTiles t) {
#if defined(MOELINK_EXPERTS_TILE_SWEEP)
  (void)t;
  return true;
#else
  return t == GemmTiles::kSwap128N32 || t == GemmTiles::kRows64 || t == GemmTiles::kRows128 ||
         t == GemmTiles::kRows128C2;
#endif
}

int64_t gemm_tile_count(GemmTiles tiles, int64_t groups, int64_t rows, int64_t n) {
  const GemmTileExtent e = gemm_tile_extent(tiles);
  return groups * ((rows + e.rows - 1) / e.rows) * ((n + e.cols - 1) / e.cols);
}

bool raster_along_n_for(GemmTiles tiles, int64_t rows, int sm_count) {
  const int64_t tile_rows = gemm_tile_extent(tiles).rows;
  return 2 * ((rows + tile_rows - 1) / tile_rows) > sm_count;
}

int balanced_ctas(int64_t tile_count, int sm_count, int cluster) {
  const int64_t clusters = std::max(sm_count / cluster, 1);
  const int64_t units = (std::max<int64_t>(tile_count, 1) + cluster - 1) / cluster;
  const int64_t waves = (units + clusters - 1) / clusters;
  return static_cast<int>((units + waves - 1) / waves * cluster);
}

std::unique_ptr<BlockScaledGemm> make_block_scaled_gemm(GemmTiles tiles, int groups, GemmGrid grid) {
  switch (tiles) {
    case GemmTiles::kSwap128N32: return make_gemm_kSwap128N32(groups, grid);
    case GemmTiles::kRows64: return make_gemm_kRows64(groups, grid);
    case GemmTiles::kRows128: return make_gemm_kRows128(groups, grid);
    case GemmTiles::kRows128C2: return make_gemm_kRows128C2(groups, grid);
#if defined(MOELINK_EXPERTS_TILE_SWEEP)
    case GemmTiles::kRows64Plain: return make_gemm_kRows64Plain(groups, grid);
    case GemmTiles::kRows128Plain: return make_gemm_kRows128Plain(groups, grid);
#endif
    default: break;
  }
  throw InvalidArgument(std::string("moelink: Experts: GEMM tiles '") + gemm_tiles_name(tiles) +
                        "' are not in this build (configure with -DMOELINK_EXPERTS_TILE_SWEEP=ON)");
}

}  // namespace moelink::detail::experts
