// The CUTLASS kernel of each GemmTiles value (block_scaled_gemm.h): tile
// shape, cluster shape, schedule, operand order. Each is compiled in its own
// translation unit, generated from gemm_tile_config.cu.in by CMake.
#pragma once

#include "experts/cuda/block_scaled_gemm_sm90.cuh"

namespace moelink::detail::experts {

namespace tiles {
using cute::_1;
using cute::_128;
using cute::_16;
using cute::_2;
using cute::_32;
using cute::_64;
using PingPong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
using PingPongEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using CooperativeEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
template <class M, class N>
using Shape = cute::Shape<M, N, _128>;
template <class Cm>
using Cluster = cute::Shape<Cm, _1, _1>;
}  // namespace tiles

template <GemmTiles T>
struct TileConfig;

// gemm_tile_extent (block_scaled_gemm.h: the host's view) against a row of
// the table below.
constexpr bool tile_extent_is(GemmTiles t, int m, int n, int cluster, unsigned options) {
  const GemmTileExtent e = gemm_tile_extent(t);
  const bool swap = (options & kSwapOperands) != 0;
  return e.rows == (swap ? n : m) && e.cols == (swap ? m : n) && e.cluster == cluster;
}

#define MOELINK_TILE_CONFIG(name, m, n, cm, schedule, options)                                \
  template <>                                                                                 \
  struct TileConfig<GemmTiles::name> {                                                        \
    using Kernel = Sm90BlockScaledKernel<tiles::Shape<tiles::m, tiles::n>, tiles::Cluster<tiles::cm>, \
                                         tiles::schedule, tiles::schedule##Epilogue, options>; \
  };                                                                                          \
  static_assert(tile_extent_is(GemmTiles::name, tiles::m::value, tiles::n::value,             \
                               tiles::cm::value, options),                                    \
                "gemm_tile_extent(" #name ") disagrees with its kernel");

// Swapped operands need 128-row tiles: the weights' scales come per 128 rows.
// name               tile M  tile N  cluster M  schedule     options (KernelOptions)
MOELINK_TILE_CONFIG(kRows64,       _64,   _128,  _1,  PingPong,    kOverlapPromotion)
MOELINK_TILE_CONFIG(kRows128,      _128,  _128,  _1,  Cooperative, kOverlapPromotion)
MOELINK_TILE_CONFIG(kRows128C2,    _128,  _128,  _2,  Cooperative, kOverlapPromotion)
MOELINK_TILE_CONFIG(kSwap128N32,   _128,  _32,   _1,  Cooperative, kSwapOperands)
MOELINK_TILE_CONFIG(kRows64Plain,  _64,   _128,  _1,  PingPong,    0)
MOELINK_TILE_CONFIG(kRows128Plain, _128,  _128,  _1,  Cooperative, 0)
#undef MOELINK_TILE_CONFIG

// The split-K partial sums (make_split_k_gemm), fp32 out: kSwap128N32's
// tiles (split_k.cu), and kRows128's for a dense GEMM of 33 or more rows
// under a forced MOELINK_EXPERTS_SPLIT_K (split_k_rows128.cu; measured no
// faster than whole on qkv_a, so auto leaves row tiles whole).
using SplitKKernel = Sm90BlockScaledKernel<tiles::Shape<tiles::_128, tiles::_32>, tiles::Cluster<tiles::_1>,
                                           tiles::Cooperative, tiles::CooperativeEpilogue, kSwapOperands,
                                           float>;
using SplitKRows128Kernel =
    Sm90BlockScaledKernel<tiles::Shape<tiles::_128, tiles::_128>, tiles::Cluster<tiles::_1>, tiles::Cooperative,
                          tiles::CooperativeEpilogue, kOverlapPromotion, float>;

// SplitKRows128Kernel's GEMM (split_k_rows128.cu: its own translation unit,
// compiled beside split_k.cu's; make_split_k_gemm picks it).
std::unique_ptr<BlockScaledGemm> make_split_k_rows128_gemm(int groups, GemmGrid grid);

}  // namespace moelink::detail::experts
