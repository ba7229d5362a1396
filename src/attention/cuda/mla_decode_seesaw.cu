// moelink's MLA decode on Hopper's warpgroup MMAs with the two warpgroups
// out of step ("seesaw") and the keys loaded by TMA, for more than 32 heads
// (64 heads of one decode row a block; DeepSeek-V3's cache rows, latent 512
// + rotary 64). An A/B candidate against mla_decode_wgmma.cu's kernel,
// where both warpgroups score every stage together and load by cp.async
// (MOELINK_MLA_DECODE_SEESAW=1 picks this one; docs/attention.md).
//
// The stages (64 keys each) alternate between two tiles: warpgroup 0 scores
// the even stages (tile 0), warpgroup 1 the odd ones (tile 1), each over all
// 64 keys of its stage (m64n64k16). Warpgroup 0 accumulates output dims
// 0-255, warpgroup 1 dims 256-511, so each stage's P V runs in both: a
// warpgroup multiplies its own probabilities from registers and the
// other's from shared memory. Per pair of stages (2p in tile 0, 2p + 1 in
// tile 1), each warpgroup multiplies its own stage first:
//   wg 0: S0 = Q K0; m0 = max(m, rowmax S0) -> shared; P0 = exp(S0 - m0);
//         O_L *= exp(m - m0); O_L += P0 V0_L (P0 from registers); then,
//         with wg 1's m1 and P1: exp(S0 - m1) -> shared (P0 on wg 1's
//         maxima); O_L *= exp(m0 - m1); O_L += P1 V1_L;
//   wg 1: S1 = Q K1; with wg 0's m0: m1 = max(m0, rowmax S1) -> shared;
//         P1 = exp(S1 - m1) -> shared; O_R *= exp(m - m1); O_R += P1 V1_R
//         (P1 from registers); then O_R += P0 V0_R (P0 on m1).
// So one warpgroup's softmax runs under the other's MMAs; the warpgroups
// meet at three named barriers (m0 published, m1 and P1 ready, P0 stored),
// never at a block-wide one inside the loop. Warpgroup 1's own stage
// first frees its half of tile 1 early in the pair, so the refill the
// next pair's scores wait for is on its way sooner (the other stage first,
// P0 V0_R under wg 1's softmax, was 4 % slower at 128 requests of 128
// heads on an H100; docs/attention.md). A stage's P goes into its tile's
// rotary atom (dims 512-575), which the P V never reads: Q and two tiles
// fit (218 KB with the barriers).
//
// Loads: a tile's 9 atoms (64 dims each) are two groups, each refilled by
// the warpgroup that reads it last, as soon as that read is done, by TMA
// (one thread, the cache's tensor map, 128-byte swizzle) on the group's own
// transaction barrier: warpgroup g's group is its half of the latent
// (atoms 4g .. 4g + 3, its P V's values), plus the rotary atom of the tile
// the other warpgroup scores (that atom holds the other's P, which g reads
// last). The scorer waits for the two groups one after the other, issuing
// the first group's score MMAs while the second still lands. Keys past the
// split's end (the last stage's tail; a last odd stage entirely) are loaded
// from the row's last pages and masked; before its P V of such a stage a
// warpgroup zeros those rows of its values, as the cache there may hold
// anything and 0 x NaN is NaN.
#include <cuda.h>
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "attention/cuda/mla_decode_split.cuh"
#include "attention/cuda/mla_decode_tc.h"
#include "attention/cuda/mla_decode_wgmma_rows.cuh"
#include "attention/cuda/tma.cuh"
#include "attention/cuda/tma_map.h"
#include "attention/cuda/wgmma.cuh"
#include "core/arg_checks.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {
namespace {

using namespace decode;
using namespace wgmma;

constexpr int kHeads = 64;  // a block's heads: wgmma's M
constexpr int kLatent = 512, kRow = kLatent + kRope;
constexpr int kChunks = kRow / 8;                     // 16-byte pieces of a row
constexpr int kThreads = 256;                         // two warpgroups
constexpr int kRotaryAtom = kLatent / 64;             // atom 8: a tile's rotary dims, then its stage's P
constexpr uint32_t kTile = (kRow / 64) * kAtomBlock;  // 64 rows x 576 dims: 72 KB
constexpr uint32_t kPOffset = kRotaryAtom * kAtomBlock;
constexpr uint32_t kRedBytes = 4 * kHeads * 4;  // the published maxima and the row sums
constexpr uint32_t kBarrierBytes = 4 * 8;       // a transaction barrier per tile and load group
constexpr size_t kSmemBytes = 3 * size_t(kTile) + kRedBytes + kBarrierBytes + 1024;  // + alignment to 1024
static_assert(kSmemBytes <= 227 * 1024, "past a Hopper block's shared memory");

// Named barriers: m0 published (wg 0 arrives, wg 1 waits), m1 and P1 ready
// (the reverse), each warpgroup's own (before it refills a group or uses
// the rows it zeroed), and P0 stored (wg 0's P0 on m1; wg 0 arrives).
enum Barrier : int { kM0Ready = 1, kP1Ready, kOwnSync, kP0Stored = kOwnSync + 2 };

__device__ __forceinline__ float base_of(float m) { return m == -INFINITY ? 0.0f : m; }

// The accumulator's rows row0 (elements 4 j, 4 j + 1) times f0 and row1
// (4 j + 2, 4 j + 3) times f1.
__device__ __forceinline__ void scale_rows(float (&out)[128], float f0, float f1) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    out[4 * j] *= f0, out[4 * j + 1] *= f0;
    out[4 * j + 2] *= f1, out[4 * j + 3] *= f1;
  }
}

// Load group `group` of tile `tile`: the latent atoms 4 group .. 4 group + 3
// and, where the group's warpgroup is the tile's other (not its scorer),
// the rotary atom.
__device__ __forceinline__ int group_atoms(int tile, int group) { return group == 1 - tile ? 5 : 4; }
__device__ __forceinline__ int group_atom(int group, int i) { return i < 4 ? 4 * group + i : kRotaryAtom; }

// Clock stamps of the kernel's phases, for tuning:
// MOELINK_MLA_DECODE_SEESAW_TRACE=<prefix> runs the process's first three
// eager launches stamped and writes <prefix>.<n>.bin (read by
// tools/bench/seesaw_trace_report.py). Each warpgroup's first thread stamps
// the first kBlocks blocks' first kPairs pairs of stages; a thread's stamps
// are its SM's clock, so only differences within a block mean anything.
struct SeesawTrace {
  enum Event : int {
    kPairStart,
    kOwnGroup,       // its score MMAs' own load group landed
    kOtherGroup,     // the other group landed
    kScores,         // the score MMAs done
    kExchange,       // wg 0: wg 1's m1 and P1 ready; wg 1: wg 0's m0 ready
    kOwnPvIssued,    // P V of its own stage issued
    kOwnPvDone,
    kOtherPvIssued,  // P V of the other's stage issued
    kOtherPvDone,
    kEvents
  };
  static constexpr int kBlocks = 16, kPairs = 48;
  uint64_t* out;  // [kBlocks][kPairs][2 warpgroups][kEvents] clock cycles; null: no stamps

  __device__ __forceinline__ void stamp(int wg, int wtid, int pair, Event e) const {
    const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (wtid != 0 || block >= kBlocks || pair >= kPairs) return;
    uint64_t t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    out[((block * kPairs + pair) * 2 + wg) * kEvents + e] = t;
  }
};

// box_rows: the tensor map's box height, gcd(page_size, 64) (a box never
// crosses a page). kTrace: SeesawTrace's clock stamps (tuning only).
template <bool kTrace>
__global__ void __launch_bounds__(kThreads, 1) seesaw_decode_kernel(TcDecodeArgs a, void* workspace,
                                                                    int inner_head_blocks, int box_rows,
                                                                    const __grid_constant__ CUtensorMap cache_map,
                                                                    SeesawTrace trace) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint32_t q_tile = base, tiles = base + kTile;
  float* max_pub = reinterpret_cast<float*>(smem_raw + (base + 3 * kTile - raw));  // [2 warpgroups][64 heads]
  float* red_sum = max_pub + 2 * kHeads;                                           // [2 warpgroups][64 heads]
  const uint32_t barriers = base + 3 * kTile + kRedBytes;  // [tile][group], 8 bytes each

  // The grid as mla_decode_wgmma.cu's (inner_head_blocks > 0: a row's head blocks side by side).
  const int64_t r = inner_head_blocks > 0 ? blockIdx.x / inner_head_blocks : blockIdx.x;
  const int64_t decode_rows = a.plan.decode_rows[0];
  const int head0 = (inner_head_blocks > 0 ? blockIdx.x % inner_head_blocks : blockIdx.y) * kHeads;
  const int split = blockIdx.z, splits = gridDim.z;
  if (r >= decode_rows) return;
  const int32_t request = a.plan.request[r];
  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128, lane = tid % 32;
  int trace_pair = 0;
  auto stamp = [&](SeesawTrace::Event e) {
    if constexpr (kTrace) trace.stamp(wg, wtid, trace_pair, e);
  };
  if (request < 0) {
    if (splits == 1) zero_skipped_row(a.out_latent, a.Nd, r, head0, kHeads, a.heads, kLatent, tid, kThreads);
    return;
  }
  // A thread's accumulator rows (heads head0 + row) and first column.
  const int row0 = wtid / 32 * 16 + lane / 4, row1 = row0 + 8, c2 = (lane % 4) * 2;
  const KeyRange range = split_keys(static_cast<int64_t>(a.plan.position[r]) + 1, split, splits);
  const Partials part = partials_of(workspace, splits, a.Nd, a.heads, kLatent);
  if (range.begin >= range.end) return mark_empty_split(part, a.Nd, split, r, head0, kHeads, a.heads, tid);
  const int64_t key_end[2] = {range.end, range.end};
  const int stages = static_cast<int>((range.end - range.begin + kKeysPerStage - 1) / kKeysPerStage);
  const int pairs = (stages + 1) / 2;
  const int32_t* block_row = a.block_table + static_cast<int64_t>(request) * a.block_stride;
  const uint32_t my_tile = tiles + wg * kTile, other_tile = tiles + (1 - wg) * kTile;
  auto barrier_of = [&](int tile, int group) { return barriers + (2 * tile + group) * 8; };
  // Key k's row of the cache (the tensor map's outer coordinate).
  auto cache_row_of = [&](int64_t k) {
    return static_cast<int32_t>(static_cast<int64_t>(block_row[k / a.page_size]) * a.page_size + k % a.page_size);
  };

  // Group `group` of stage `stage`'s tile <- its keys, by TMA (one thread):
  // boxes of box_rows keys, each inside a page; boxes past the range's end
  // repeat the range's last box (masked, their values zeroed before use).
  auto load_group = [&](int stage, int group) {
    const int tile = stage & 1, atoms = group_atoms(tile, group);
    const uint32_t bar = barrier_of(tile, group), dst = tiles + tile * kTile;
    tma::arrive_expect_tx(bar, atoms * kAtomBlock);
    const int64_t k0 = range.begin + static_cast<int64_t>(stage) * kKeysPerStage;
    const int64_t last_box = (range.end - 1) / box_rows * box_rows;
    for (int j = 0; j < kKeysPerStage / box_rows; ++j) {
      const int32_t cache_row = cache_row_of(min(k0 + j * box_rows, last_box));
      for (int i = 0; i < atoms; ++i) {
        const int atom = group_atom(group, i);
        tma::load_2d(dst + atom * kAtomBlock + j * box_rows * 128, &cache_map, atom * 64, cache_row, bar);
      }
    }
  };
  if (tid == 0) {
    for (int b = 0; b < 4; ++b) tma::barrier_init(barriers + b * 8, 1);
    tma::fence_barrier_init();
    tma::prefetch_map(&cache_map);
    for (int stage = 0; stage < 2; ++stage)  // stage 1 may lie past the range: masked
      for (int group = 0; group < 2; ++group) load_group(stage, group);
  }

  // The queries: 4 threads a head, heads past a.heads zeros.
  {
    const int my_row = tid / 4, h = head0 + my_row;
    const bool valid = h < a.heads;
    const uint16_t* latent = a.q_latent + (static_cast<int64_t>(h) * a.Nd + r) * kLatent;
    const uint16_t* rotary = a.q + r * a.q_stride + static_cast<int64_t>(h) * a.head_dim + a.nope_dims;
#pragma unroll
    for (int m = 0; m < kChunks / 4; ++m) {
      const int c = tid % 4 + 4 * m;
      const uint16_t* src = c < kLatent / 8 ? latent + c * 8 : rotary + (c - kLatent / 8) * 8;
      cp_async_16(q_tile + tile_offset(my_row, c), valid ? src : a.q_latent, valid);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // the queries (loaded by both warpgroups) and the barriers' initialization

  float out[128];  // rows row0 / row1, dims 256 wg + 8 j + c2 (+1): out[4 j + {0, 1}] / out[4 j + {2, 3}]
#pragma unroll
  for (int i = 0; i < 128; ++i) out[i] = 0.0f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // log2 domain; this thread's share
  const float scale = a.scale * kLog2e;
  float sc[32];   // scores: rows row0 / row1, keys 8 j + c2 (+1) of the stage
  uint32_t pa[16];  // probabilities as wgmma's A fragments: K step k of 16 keys in pa[4 k .. 4 k + 3]

  // S = Q K^T over this warpgroup's tile (its own group's atoms first, while
  // the other's may still land), masked and in log2 units; the row maxima
  // (over the quad) to mx.
  auto scores = [&](int stage, float (&mx)[2]) {
    const uint32_t parity = (stage >> 1) & 1;  // the tile's fill stage / 2
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.0f;
    fence_registers(sc);
    auto score_atom = [&](int atom) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_64x64_ss(sc, smem_desc(q_tile + atom * kAtomBlock + k * 32, 16, 1024),
                     smem_desc(my_tile + atom * kAtomBlock + k * 32, 16, 1024));
    };
    tma::wait_parity(barrier_of(wg, wg), parity);  // this warpgroup's group: its latent half
    stamp(SeesawTrace::kOwnGroup);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i) score_atom(group_atom(wg, i));
    tma::wait_parity(barrier_of(wg, 1 - wg), parity);  // the other's: the other latent half and the rotary atom
    stamp(SeesawTrace::kOtherGroup);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < 5; ++i) score_atom(group_atom(1 - wg, i));
    wgmma_commit();
    wgmma_wait<0>();
    stamp(SeesawTrace::kScores);
    fence_registers(sc);
    scale_mask_max<8>(sc, range.begin + static_cast<int64_t>(stage) * kKeysPerStage + c2, key_end, scale, mx);
  };
  // P = exp2(S - base) into pa (bf16) and, to_shared, this tile's P atom;
  // returns the rows' sums of this thread's share.
  auto store_p = [&](int j, uint32_t lo, uint32_t hi) {  // n8 tile j's two rows into this tile's P atom
    const int col = j * 8 + c2;
    const uint32_t in_piece = (col % 8) * 2;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_tile + kPOffset + tile_offset(row0, col / 8) + in_piece),
                 "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_tile + kPOffset + tile_offset(row1, col / 8) + in_piece),
                 "r"(hi));
  };
  auto probabilities = [&](const float (&b)[2], float (&sum)[2], bool to_shared) {
    sum[0] = sum[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = exp2f(sc[4 * j] - b[0]), p1 = exp2f(sc[4 * j + 1] - b[0]);
      const float p2 = exp2f(sc[4 * j + 2] - b[1]), p3 = exp2f(sc[4 * j + 3] - b[1]);
      sum[0] += p0 + p1;
      sum[1] += p2 + p3;
      // n8 tile j is half of K step j / 2: rows 0 / 8 in registers 0 / 1 (j even) or 2 / 3 (j odd).
      const uint32_t lo = pack_bf16(p0, p1), hi = pack_bf16(p2, p3);
      pa[4 * (j / 2) + 2 * (j % 2)] = lo;
      pa[4 * (j / 2) + 2 * (j % 2) + 1] = hi;
      if (to_shared) store_p(j, lo, hi);
    }
    if (to_shared) fence_proxy_async();
  };
  // P = exp2(S - b) into this tile's P atom only (wg 0's P0 on wg 1's maxima).
  auto store_rescaled = [&](const float (&b)[2]) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      store_p(j, pack_bf16(exp2f(sc[4 * j] - b[0]), exp2f(sc[4 * j + 1] - b[0])),
              pack_bf16(exp2f(sc[4 * j + 2] - b[1]), exp2f(sc[4 * j + 3] - b[1])));
    fence_proxy_async();
  };
  // Before this warpgroup's P V of stage `stage`: its values (atoms 4 wg ..
  // 4 wg + 3) past the range's end zeros.
  auto zero_tail = [&](int stage) {
    const int64_t valid = range.end - (range.begin + static_cast<int64_t>(stage) * kKeysPerStage);
    if (valid >= kKeysPerStage) return;
    const int first = valid > 0 ? static_cast<int>(valid) : 0;
    const uint32_t tile = tiles + (stage & 1) * kTile + 4 * wg * kAtomBlock;
    for (int i = wtid; i < (kKeysPerStage - first) * 32; i += 128) {  // rows x 4 atoms x 8 pieces
      const int row = first + i / 32, atom = (i / 8) % 4, piece = i % 8;
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(tile + atom * kAtomBlock + row * 128 +
                                                                       piece * 16),
                   "r"(0));
    }
    fence_proxy_async();
    barrier_sync(kOwnSync + wg, 128);
  };
  // This warpgroup's group of tile stage & 1 <- stage `stage`, once every
  // thread's MMAs reading it are done (the caller waited for them).
  auto refill = [&](int stage) {
    barrier_sync(kOwnSync + wg, 128);
    if (wtid == 0) load_group(stage, wg);
  };
  // out += P V over a tile's 64 keys and this warpgroup's 256 dims: P from
  // registers (own stage) or from the tile's P atom (the other's). One group.
  auto issue_pv_own = [&](uint32_t tile) {
    fence_registers(out);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKeysPerStage / 16; ++k) {
      const uint32_t frag[4] = {pa[4 * k], pa[4 * k + 1], pa[4 * k + 2], pa[4 * k + 3]};
      mma_64x256_rs(out, frag, smem_desc(tile + wg * 4 * kAtomBlock + k * 16 * 128, kAtomBlock, 1024));
    }
    wgmma_commit();
  };
  auto issue_pv_other = [&](uint32_t tile) {
    fence_registers(out);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKeysPerStage / 16; ++k)
      mma_64x256_ss(out, smem_desc(tile + kPOffset + k * 32, 16, 1024),
                    smem_desc(tile + wg * 4 * kAtomBlock + k * 16 * 128, kAtomBlock, 1024));
    wgmma_commit();
  };
  auto publish_max = [&](const float (&m)[2]) {
    if (lane % 4 == 0) {
      max_pub[wg * kHeads + row0] = m[0];
      max_pub[wg * kHeads + row1] = m[1];
    }
  };
  auto read_max = [&](int from, float (&m)[2]) {
    m[0] = max_pub[from * kHeads + row0];
    m[1] = max_pub[from * kHeads + row1];
  };

  // The barriers order every reuse: a group is refilled only after its
  // last reader's MMAs, the next stage's scorer waits for the refill, and
  // a warpgroup publishes its next maxima and P only after that wait, so
  // after the other has read the previous ones.
  for (int p = 0; p < pairs; ++p) {
    const bool refill_next = p + 1 < pairs;
    float mx[2], sum[2];
    trace_pair = p;
    stamp(SeesawTrace::kPairStart);
    scores(2 * p + wg, mx);
    if (wg == 0) {
      float m0[2], b0[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m0[h] = fmaxf(run_max[h], mx[h]);
        b0[h] = base_of(m0[h]);
      }
      publish_max(m0);
      barrier_arrive(kM0Ready, kThreads);
      probabilities(b0, sum, false);
#pragma unroll
      for (int h = 0; h < 2; ++h) run_sum[h] = run_sum[h] * exp2f(run_max[h] - b0[h]) + sum[h];
      scale_rows(out, exp2f(run_max[0] - b0[0]), exp2f(run_max[1] - b0[1]));
      zero_tail(2 * p);
      issue_pv_own(my_tile);
      stamp(SeesawTrace::kOwnPvIssued);
      barrier_sync(kP1Ready, kThreads);  // wg 1's maxima m1 and P1
      stamp(SeesawTrace::kExchange);
      float m1[2], b1[2];
      read_max(1, m1);
      b1[0] = base_of(m1[0]), b1[1] = base_of(m1[1]);
      store_rescaled(b1);
      barrier_arrive(kP0Stored, kThreads);
      wgmma_wait<0>();
      stamp(SeesawTrace::kOwnPvDone);
      fence_registers(out);
      fence_registers(pa);
      if (refill_next) refill(2 * p + 2);  // tile 0's values 0-255: read
      const float g0 = exp2f(m0[0] - b1[0]), g1 = exp2f(m0[1] - b1[1]);
      run_sum[0] *= g0, run_sum[1] *= g1;
      scale_rows(out, g0, g1);
      zero_tail(2 * p + 1);
      issue_pv_other(other_tile);
      stamp(SeesawTrace::kOtherPvIssued);
      wgmma_wait<0>();
      stamp(SeesawTrace::kOtherPvDone);
      fence_registers(out);
      if (refill_next) refill(2 * p + 3);  // tile 1's values 0-255 and P1: read
      run_max[0] = m1[0], run_max[1] = m1[1];
    } else {
      barrier_sync(kM0Ready, kThreads);  // wg 0's maxima m0
      stamp(SeesawTrace::kExchange);
      float m0[2], m1[2], b1[2];
      read_max(0, m0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m1[h] = fmaxf(m0[h], mx[h]);
        b1[h] = base_of(m1[h]);
      }
      probabilities(b1, sum, true);
      publish_max(m1);
      barrier_arrive(kP1Ready, kThreads);
      const float f0 = exp2f(run_max[0] - b1[0]), f1 = exp2f(run_max[1] - b1[1]);
      run_sum[0] = run_sum[0] * f0 + sum[0];
      run_sum[1] = run_sum[1] * f1 + sum[1];
      scale_rows(out, f0, f1);
      zero_tail(2 * p + 1);
      issue_pv_own(my_tile);
      stamp(SeesawTrace::kOwnPvIssued);
      zero_tail(2 * p);
      barrier_sync(kP0Stored, kThreads);  // wg 0's P0 on m1
      issue_pv_other(other_tile);
      stamp(SeesawTrace::kOtherPvIssued);
      wgmma_wait<1>();
      stamp(SeesawTrace::kOwnPvDone);
      fence_registers(pa);
      if (refill_next) refill(2 * p + 3);  // tile 1's values 256-511: read
      wgmma_wait<0>();
      stamp(SeesawTrace::kOtherPvDone);
      fence_registers(out);
      if (refill_next) refill(2 * p + 2);  // tile 0's values 256-511 and P0: read
      run_max[0] = m1[0], run_max[1] = m1[1];
    }
  }

  const int head[2] = {head0 + row0, head0 + row1};
  const int64_t out_row[2] = {head[0] < a.heads ? r : -1, head[1] < a.heads ? r : -1};
  write_warpgroup_rows(a, part, split, splits, {wg, lane, row0, row1, c2}, out, run_sum, run_max, red_sum, head,
                       out_row);
#endif
}

}  // namespace

bool seesaw_decode_applies(const TcDecodeArgs& a) {
  // TMA's boxes: at least 8 rows (1024 bytes, the swizzle's period) inside
  // a page; cache rows addressed in 32 bits.
  return a.heads > kHeads / 2 && std::gcd(a.page_size, kKeysPerStage) >= 8 &&
         a.num_pages * a.page_size <= INT32_MAX;
}

namespace {

// The stamped kernel, where MOELINK_MLA_DECODE_SEESAW_TRACE asks and
// `stream` is not capturing: runs it, waits for it and writes its stamps.
// Returns whether it ran.
bool run_traced(const TcDecodeArgs& a, void* workspace, dim3 grid, int inner_head_blocks, int box_rows,
                const CUtensorMap& cache_map, cudaStream_t stream) {
  static const char* prefix = std::getenv("MOELINK_MLA_DECODE_SEESAW_TRACE");
  static std::atomic<int> traced{0};
  if (prefix == nullptr || *prefix == '\0' || traced.load() >= 3) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOELINK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  const size_t count = size_t{SeesawTrace::kBlocks} * SeesawTrace::kPairs * 2 * SeesawTrace::kEvents;
  SeesawTrace trace{nullptr};
  MOELINK_CUDA_CHECK(cudaMallocAsync(&trace.out, count * 8, stream));
  MOELINK_CUDA_CHECK(cudaMemsetAsync(trace.out, 0, count * 8, stream));
  seesaw_decode_kernel<true><<<grid, kThreads, kSmemBytes, stream>>>(a, workspace, inner_head_blocks, box_rows,
                                                                      cache_map, trace);
  MOELINK_CUDA_CHECK(cudaGetLastError());
  std::vector<uint64_t> stamps(count);
  MOELINK_CUDA_CHECK(cudaMemcpyAsync(stamps.data(), trace.out, count * 8, cudaMemcpyDeviceToHost, stream));
  MOELINK_CUDA_CHECK(cudaFreeAsync(trace.out, stream));
  MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::string path = std::string(prefix) + "." + std::to_string(traced++) + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  const bool written = f != nullptr && std::fwrite(stamps.data(), 8, count, f) == count;
  if (f != nullptr) std::fclose(f);
  std::fprintf(stderr, "moelink: seesaw decode trace %s %s\n", path.c_str(), written ? "written" : "NOT written");
  return true;
}

}  // namespace

void launch_seesaw_decode(const TcDecodeArgs& a, void* workspace, dim3 grid, int inner_head_blocks,
                          cudaStream_t stream) {
  static std::once_flag attribute_set;
  std::call_once(attribute_set, [] {
    for (const void* kernel : {reinterpret_cast<const void*>(seesaw_decode_kernel<false>),
                               reinterpret_cast<const void*>(seesaw_decode_kernel<true>)})
      MOELINK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kSmemBytes)));
  });
  const int box_rows = std::gcd(a.page_size, kKeysPerStage);
  const CUtensorMap cache_map =
      bf16_swizzled_row_map(a.cache, kRow, static_cast<uint64_t>(a.num_pages) * a.page_size, kRow * 2, box_rows);
  if (run_traced(a, workspace, grid, inner_head_blocks, box_rows, cache_map, stream)) return;
  seesaw_decode_kernel<false><<<grid, kThreads, kSmemBytes, stream>>>(a, workspace, inner_head_blocks, box_rows,
                                                                       cache_map, SeesawTrace{nullptr});
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::attention
