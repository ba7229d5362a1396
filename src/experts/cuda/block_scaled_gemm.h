// The fp8 block-scaled grouped GEMM of the expert kernels, as the host code
// sees it (no CUTLASS types here):
//   for each group g < groups, rows r < rows(g), columns n < N:
//     y[g][r][n] = bf16( sum_kb  x_scale[g][r][kb] * w_scale[g][n/128][kb]
//                               * sum_{k in block kb} x[g][r][k] * w[g][n][k] )
// x fp8 e4m3 [groups, C, K] (K contiguous), w fp8 e4m3 [groups, N, K] (K
// contiguous: a checkpoint's [out, in] weight), x_scale fp32 [groups, C, K/128]
// packed rows, w_scale fp32 [groups, N/128, K/128] packed rows, y bf16
// [groups, C, N] (N contiguous). rows(g) is read on the device: either
// counts[g] (the grouped GEMM on dispatch's output) or counts[0] for the only
// group (a dense GEMM whose m is on the device), clamped to [0, C]. Rows >= rows(g)
// of y are never written.
//
// The core is CUTLASS's Hopper warp-specialized grouped GEMM with blockwise
// scaling (TMA loads, wgmma, scale promotion every 128 of K); a small kernel
// before it writes CUTLASS's per-group arguments (problem sizes, pointers,
// strides) from the counts on the device, so nothing is read back by the host
// and a captured CUDA graph replays with new counts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "experts/expert_error.h"

namespace moelink::detail::experts {

struct GemmOperands {
  const void* x;  // fp8
  int64_t x_group_stride, x_row_stride;  // elements
  const float* x_scale;
  int64_t x_scale_group_stride;  // elements; rows are K/128 apart
  const void* w;  // fp8
  int64_t w_group_stride, w_row_stride;
  const float* w_scale;
  int64_t w_scale_group_stride;  // rows are K/128 apart
  void* y;  // bf16
  int64_t y_group_stride, y_row_stride;
  const int32_t* counts;  // [groups] rows per group, device memory
  int64_t capacity;       // C: rows each group's tensors have
  int32_t n, k;           // multiples of 128
  ExpertOp op;            // named when a count is out of range

  // Split over K (split_k > 1; the GEMM object of make_split_k_gemm, with
  // split_k * groups groups): group s * groups + g multiplies group g's K
  // slice s, [s k/split_k, (s+1) k/split_k), into partial[s * groups + g]
  // ([capacity, n] fp32, n contiguous), with the slice's scales packed
  // first (run() does it); launch_split_reduce then sums the slices into y.
  // split_k divides k / 128. 0 or 1: no split (the fields below unused).
  int32_t split_k;
  int32_t groups;         // g's range
  float* partial;         // [split_k * groups, capacity, n]
  float* x_scale_split;   // [split_k * groups, capacity, k / split_k / 128]
  float* w_scale_split;   // [split_k * groups, n / 128, k / split_k / 128]
};

// Tile configurations (gemm_tile_configs.cuh). The build always compiles
// the defaults, kSwap128N32, kRows64, kRows128 and kRows128C2
// (cuda_experts.cc picks one by the expected rows per group); the others are
// candidates compiled with -DMOELINK_EXPERTS_TILE_SWEEP=ON for
// tools/bench/experts_bench.py --tiles. MOELINK_EXPERTS_TILES=<name> forces one.
enum class GemmTiles {
  // 64 x 128 x 128 tiles (rows x N x K), ping-pong consumer warpgroups: one
  // warpgroup's epilogue overlaps the other's mainloop. Promotion overlapped
  // with the next k-tile's wgmma (OverlappedPromotionMainloop).
  kRows64,
  // 128 x 128 x 128 tiles, two cooperative consumer warpgroups, promotion
  // overlapped.
  kRows128,
  // kRows128 in clusters of 2 CTAs along M: each w tile is loaded once from
  // L2 and multicast to both. Pays when a group has 2+ row tiles (a lone
  // tile leaves its cluster's other CTA idle).
  kRows128C2,
  // Swapped operands (D^T = w . x^T): 128 weight rows by 32 token rows,
  // cooperative, CUTLASS's mainloop. Decode: a tile's wgmma is not mostly
  // padding, and the GEMM streams weights, so promotion does not limit it.
  kSwap128N32,
  // Candidates: kRows64 and kRows128 on CUTLASS's own mainloop (each k-tile
  // promoted after its wgmma finished, before the next is issued).
  kRows64Plain,
  kRows128Plain,
};
constexpr GemmTiles kAllGemmTiles[] = {GemmTiles::kRows64,      GemmTiles::kRows128,
                                       GemmTiles::kRows128C2,   GemmTiles::kSwap128N32,
                                       GemmTiles::kRows64Plain, GemmTiles::kRows128Plain};
// A tile's extent in y: token rows by output columns (swapped operands: the
// kernel's 128 x 32 tile transposed), and the CTAs of its cluster. The
// kernels' tile shapes are checked against it (gemm_tile_configs.cuh).
struct GemmTileExtent {
  int rows, cols, cluster;
};
constexpr GemmTileExtent gemm_tile_extent(GemmTiles t) {
  switch (t) {
    case GemmTiles::kSwap128N32: return {32, 128, 1};
    case GemmTiles::kRows64:
    case GemmTiles::kRows64Plain: return {64, 128, 1};
    case GemmTiles::kRows128:
    case GemmTiles::kRows128Plain: return {128, 128, 1};
    case GemmTiles::kRows128C2: return {128, 128, 2};
  }
  return {0, 0, 0};
}
const char* gemm_tiles_name(GemmTiles t);  // "rows64", "rows128plain", ...
bool gemm_tiles_from_name(const char* name, GemmTiles* out);
bool gemm_tiles_built(GemmTiles t);  // compiled into this build

// One CUTLASS kernel with its device-side argument arrays for `groups`
// groups. Calls on one object are ordered on one stream at a time (the
// argument arrays are rewritten by each call).
class BlockScaledGemm {
 public:
  virtual ~BlockScaledGemm() = default;
  // Writes the arguments from `op.counts` on `stream`, then runs the GEMM;
  // both kernels launched with PDL when `programmatic`
  // (programmatic_launch.cuh). A count outside [0, C] is clamped and
  // recorded in *error.
  void run(const GemmOperands& op, ExpertErrorRecord* error, cudaStream_t stream, bool programmatic) {
    write_arguments(op, error, stream, programmatic, nullptr, nullptr);
    launch(stream, programmatic);
  }
  // run() in two steps. write_arguments() writes this object's argument
  // arrays for `op` and, when `second` is given (an object of the same
  // tiles; neither op split over K), `second`'s for `*second_op`, in one
  // launch; launch() runs the GEMM on the arrays as last written.
  // forward() writes both of its GEMMs' arguments before the first GEMM,
  // so that no argument kernel sits between SiLU-mul and the second.
  virtual void write_arguments(const GemmOperands& op, ExpertErrorRecord* error, cudaStream_t stream,
                               bool programmatic, BlockScaledGemm* second,
                               const GemmOperands* second_op) = 0;
  virtual void launch(cudaStream_t stream, bool programmatic) = 0;
  virtual GemmTiles tiles() const = 0;
  // Device memory the object holds (argument arrays, CUTLASS workspace).
  virtual size_t device_bytes() const = 0;
};

// How a GEMM object's persistent kernel runs through its tiles.
struct GemmGrid {
  int ctas = 0;  // blocks (balanced_ctas); 0 or more than the SMs: one per SM
  // Cooperative tiles without clusters (kSwap128N32, kRows128): a CTA's
  // tiles after its first handed out while the kernel runs
  // (DynamicGroupScheduler), not b, b + ctas, ... fixed.
  bool dynamic = true;
  // The order tiles are numbered in, within a group. false: CUTLASS's,
  // down M first (the CTAs running at once cover one or two weight tiles
  // and all of the group's rows, which are read again for every next
  // weight tile). true: along N in stripes of 8 row tiles (a stripe's rows
  // against all of the weights), for groups of so many row tiles that
  // their rows do not stay in L2 between weight tiles (raster_along_n_for).
  bool raster_along_n = false;
};

// Whether a group of `rows` rows on `tiles` should number its tiles along N
// (GemmGrid::raster_along_n): more row tiles than half of `sm_count`, so
// that down M the CTAs running at once would share less than two weight
// tiles.
bool raster_along_n_for(GemmTiles tiles, int64_t rows, int sm_count);

// For the current CUDA device. Throws SystemError when CUDA fails and
// InvalidArgument when the device is not a Hopper GPU (sm_90) or the tiles
// are not in this build.
std::unique_ptr<BlockScaledGemm> make_block_scaled_gemm(GemmTiles tiles, int groups, GemmGrid grid);

// The tiles a GEMM on `tiles` is split over K on: kSwap128N32 itself, the
// row tiles (a dense GEMM under a forced MOELINK_EXPERTS_SPLIT_K) on
// kRows128 (64-row tiles and clusters have no split kernel: a split GEMM's
// slices are what fill the SMs).
GemmTiles split_k_tiles(GemmTiles tiles);

// The split-K GEMM: split_k_tiles(tiles) with fp32 output, `groups` =
// split_k x the operands' groups (GemmOperands.split_k). Its run() packs the
// slices' scales; launch_split_reduce after it writes y.
std::unique_ptr<BlockScaledGemm> make_split_k_gemm(GemmTiles tiles, int groups, GemmGrid grid);

// Output tiles of a GEMM on `tiles` with `groups` groups of `rows` rows and
// n columns (swapped operands: a tile is 128 columns by 32 rows).
int64_t gemm_tile_count(GemmTiles tiles, int64_t groups, int64_t rows, int64_t n);

// The persistent grid for `tile_count` tiles on `sm_count` SMs, in clusters
// of `cluster` blocks: as many waves as one block per SM needs, spread evenly
// (448 tiles on 132 SMs: 4 waves either way, 112 blocks of 4 tiles rather
// than 52 of 4 and 80 of 3). A weight-streaming GEMM then ends with every
// block busy until its last tile rather than a partial last wave.
int balanced_ctas(int64_t tile_count, int sm_count, int cluster);

// The most K slices a GEMM is split into (MOELINK_EXPERTS_SPLIT_K's range).
constexpr int kMaxSplitK = 8;

// How many K slices (1, 2, 4 or 8) make a GEMM of `tiles` output tiles and
// k/128 k-blocks on `sm_count` SMs faster (1: none): a slice's tiles run in
// waves of sm_count, each paying its k-blocks plus a fixed pipeline fill,
// and a split pays for its partial sums and reduce kernel; it must gain
// 15 %.
int split_k_for(int64_t tiles, int64_t k_blocks, int sm_count);

// y[g][r][n] = bf16(sum over s of partial[s * groups + g][r][n]) for rows r
// < the group's count (clamped; the GEMM reported it).
void launch_split_reduce(const GemmOperands& op, cudaStream_t stream, bool programmatic);

}  // namespace moelink::detail::experts
