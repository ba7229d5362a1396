// moelink's MLA decode on Hopper's warpgroup MMAs with the two warpgroups
// out of step ("seesaw"), for more than 32 heads (64 heads of one decode
// row a block; DeepSeek-V3's cache rows, latent 512 + rotary 64). An A/B
// candidate against mla_decode_wgmma.cu's kernel, where both warpgroups
// score every stage together (MOELINK_MLA_DECODE_SEESAW=1 picks this one;
// on an H100, 2026-12-06: correct, about 9 % slower, docs/attention.md).
//
// The stages (64 keys each) alternate between two tiles: warpgroup 0 scores
// the even stages (tile 0), warpgroup 1 the odd ones (tile 1), each over all
// 64 keys of its stage (m64n64k16: twice the N of the lockstep kernel's
// scores). Warpgroup 0 accumulates output dims 0-255, warpgroup 1 dims
// 256-511, so each stage's P V runs in both: a warpgroup multiplies its own
// probabilities from registers and the other's from shared memory. Per
// pair of stages (2p in tile 0, 2p + 1 in tile 1):
//   wg 0: S0 = Q K0; m0 = max(m, rowmax S0); P0 = exp(S0 - m0) -> shared;
//         m0 -> shared; O_L += P0 V0_L (P0 from registers) ... then, with
//         wg 1's m1 and P1: O_L *= exp(m0 - m1); O_L += P1 V1_L;
//   wg 1: S1 = Q K1; with wg 0's m0: O_R *= exp(m - m0); O_R += P0 V0_R;
//         m1 = max(m0, rowmax S1); P1 = exp(S1 - m1) -> shared; m1 ->
//         shared; O_R *= exp(m0 - m1); O_R += P1 V1_R (P1 from registers).
// So one warpgroup's softmax runs under the other's MMAs, and the
// warpgroups meet at named barriers (P0 ready, P1 ready, a tile free),
// never at a block-wide one inside the loop. A stage's P goes into its
// tile's rotary atom (dims 512-575), which the P V never reads: the shared
// memory holds Q and two tiles (216 KB). Warpgroup g loads tile g
// (cp.async), and reloads it with stage 2 (p + 1) + g once both warpgroups'
// P V of stage 2p + g are done.
#include <cuda_bf16.h>

#include <cmath>
#include <mutex>

#include "attention/cuda/mla_decode_split.cuh"
#include "attention/cuda/mla_decode_tc.h"
#include "attention/cuda/mla_decode_wgmma_rows.cuh"
#include "attention/cuda/wgmma.cuh"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {
namespace {

using namespace decode;
using namespace wgmma;

constexpr int kHeads = 64;  // a block's heads: wgmma's M
constexpr int kLatent = 512, kRow = kLatent + kRope;
constexpr int kChunks = kRow / 8;                     // 16-byte pieces of a row
constexpr int kThreads = 256;                         // two warpgroups
constexpr uint32_t kTile = (kRow / 64) * kAtomBlock;  // 64 rows x 576 dims: 72 KB
constexpr uint32_t kPOffset = (kLatent / 64) * kAtomBlock;  // a tile's rotary atom: its stage's P
constexpr uint32_t kRedBytes = 4 * kHeads * 4;              // the published maxima and the row sums
constexpr size_t kSmemBytes = 3 * size_t(kTile) + kRedBytes + 1024;  // + alignment to 1024
static_assert(kSmemBytes <= 227 * 1024, "past a Hopper block's shared memory");

// Named barriers: P0 ready (wg 0 arrives, wg 1 waits), P1 ready (the
// reverse), tile 0 free of wg 1's P V (wg 1 arrives), tile 1 free of wg 0's,
// and each warpgroup's own (its loads landed).
enum Barrier : int { kP0Ready = 1, kP1Ready, kTile0Free, kTile1Free, kOwnLoads };

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

__global__ void __launch_bounds__(kThreads, 1) seesaw_decode_kernel(TcDecodeArgs a, void* workspace,
                                                                    int inner_head_blocks) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint32_t q_tile = base, tiles = base + kTile;
  float* max_pub = reinterpret_cast<float*>(smem_raw + (base + 3 * kTile - raw));  // [2 warpgroups][64 heads]
  float* red_sum = max_pub + 2 * kHeads;                                           // [2 warpgroups][64 heads]

  // The grid as mla_decode_wgmma.cu's (inner_head_blocks > 0: a row's head blocks side by side).
  const int64_t r = inner_head_blocks > 0 ? blockIdx.x / inner_head_blocks : blockIdx.x;
  const int64_t decode_rows = a.plan.decode_rows[0];
  const int head0 = (inner_head_blocks > 0 ? blockIdx.x % inner_head_blocks : blockIdx.y) * kHeads;
  const int split = blockIdx.z, splits = gridDim.z;
  if (r >= decode_rows) return;
  const int32_t request = a.plan.request[r];
  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128, lane = tid % 32;
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
  const int32_t* block_row = a.block_table + static_cast<int64_t>(request) * a.block_stride;
  const uint32_t my_tile = tiles + wg * kTile, other_tile = tiles + (1 - wg) * kTile;
  // This warpgroup's tile <- stage `stage` (2 threads a key; keys past the
  // range, and stages past the last, zeros: a zero P times a zero V).
  auto load_tile = [&](int stage) {
    const int key_row = wtid / 2;
    const int64_t s = range.begin + static_cast<int64_t>(stage) * kKeysPerStage + key_row;
    const bool valid = s < range.end;
    const uint16_t* src =
        valid ? a.cache + (static_cast<int64_t>(block_row[s / a.page_size]) * a.page_size + s % a.page_size) * kRow
              : a.cache;
#pragma unroll
    for (int m = 0; m < kChunks / 2; ++m) {
      const int c = wtid % 2 + 2 * m;
      cp_async_16(my_tile + tile_offset(key_row, c), src + (valid ? c * 8 : 0), valid);
    }
  };
  if (pairs > 0) load_tile(wg);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // the queries (loaded by both warpgroups) and both tiles

  float out[128];  // rows row0 / row1, dims 256 wg + 8 j + c2 (+1): out[4 j + {0, 1}] / out[4 j + {2, 3}]
#pragma unroll
  for (int i = 0; i < 128; ++i) out[i] = 0.0f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // log2 domain; this thread's share
  const float scale = a.scale * kLog2e;
  float sc[32];   // scores: rows row0 / row1, keys 8 j + c2 (+1) of the stage
  uint32_t pa[16];  // probabilities as wgmma's A fragments: K step k of 16 keys in pa[4 k .. 4 k + 3]

  // S = Q K^T over this warpgroup's tile, masked and in log2 units; the row
  // maxima (over the quad) to mx.
  auto scores = [&](int stage, float (&mx)[2]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.0f;
    fence_registers(sc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kRow / 16; ++k) {
      const uint32_t in_atom = (k % 4) * 32;
      mma_64x64_ss(sc, smem_desc(q_tile + (k / 4) * kAtomBlock + in_atom, 16, 1024),
                   smem_desc(my_tile + (k / 4) * kAtomBlock + in_atom, 16, 1024));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(sc);
    scale_mask_max<8>(sc, range.begin + static_cast<int64_t>(stage) * kKeysPerStage + c2, key_end, scale, mx);
  };
  // P = exp2(S - base) into pa (bf16) and this tile's P atom; returns the
  // rows' sums of this thread's share.
  auto probabilities = [&](const float (&b)[2], float (&sum)[2]) {
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
      const int col = j * 8 + c2;
      const uint32_t in_piece = (col % 8) * 2;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_tile + kPOffset + tile_offset(row0, col / 8) + in_piece),
                   "r"(lo));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_tile + kPOffset + tile_offset(row1, col / 8) + in_piece),
                   "r"(hi));
    }
    fence_proxy_async();
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

  for (int p = 0; p < pairs; ++p) {
    const bool reload = p + 1 < pairs;
    if (p > 0) {  // this warpgroup's reload of its tile landed
      cp_async_wait<0>();
      fence_proxy_async();
      barrier_sync(kOwnLoads + wg, 128);
    }
    float mx[2], sum[2];
    scores(2 * p + wg, mx);
    if (wg == 0) {
      float m0[2], b0[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m0[h] = fmaxf(run_max[h], mx[h]);
        b0[h] = base_of(m0[h]);
      }
      probabilities(b0, sum);
      publish_max(m0);
      barrier_arrive(kP0Ready, kThreads);
#pragma unroll
      for (int h = 0; h < 2; ++h) run_sum[h] = run_sum[h] * exp2f(run_max[h] - b0[h]) + sum[h];
      const float f0 = exp2f(run_max[0] - b0[0]), f1 = exp2f(run_max[1] - b0[1]);
      scale_rows(out, f0, f1);
      issue_pv_own(my_tile);
      barrier_sync(kP1Ready, kThreads);  // wg 1's maxima and P1
      float m1[2];
      read_max(1, m1);
      wgmma_wait<0>();
      fence_registers(out);
      fence_registers(pa);
      const float g0 = exp2f(m0[0] - base_of(m1[0])), g1 = exp2f(m0[1] - base_of(m1[1]));
      run_sum[0] *= g0, run_sum[1] *= g1;
      scale_rows(out, g0, g1);
      issue_pv_other(other_tile);
      if (reload) {  // tile 0 <- stage 2 p + 2 once wg 1's P V of stage 2 p is done
        barrier_sync(kTile0Free, kThreads);
        load_tile(2 * p + 2);
      }
      cp_async_commit();
      wgmma_wait<0>();
      fence_registers(out);
      if (reload) barrier_arrive(kTile1Free, kThreads);
      run_max[0] = m1[0], run_max[1] = m1[1];
    } else {
      barrier_sync(kP0Ready, kThreads);  // wg 0's maxima and P0
      float m0[2], m1[2], b1[2];
      read_max(0, m0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m1[h] = fmaxf(m0[h], mx[h]);
        b1[h] = base_of(m1[h]);
      }
      const float f0 = exp2f(run_max[0] - base_of(m0[0])), f1 = exp2f(run_max[1] - base_of(m0[1]));
      run_sum[0] *= f0, run_sum[1] *= f1;
      scale_rows(out, f0, f1);
      issue_pv_other(other_tile);
      probabilities(b1, sum);
      publish_max(m1);
      barrier_arrive(kP1Ready, kThreads);
      const float g0 = exp2f(m0[0] - b1[0]), g1 = exp2f(m0[1] - b1[1]);
      run_sum[0] = run_sum[0] * g0 + sum[0];
      run_sum[1] = run_sum[1] * g1 + sum[1];
      wgmma_wait<0>();
      fence_registers(out);
      if (reload) barrier_arrive(kTile0Free, kThreads);
      scale_rows(out, g0, g1);
      issue_pv_own(my_tile);
      wgmma_wait<0>();
      fence_registers(out);
      fence_registers(pa);
      if (reload) {  // tile 1 <- stage 2 p + 3 once wg 0's P V of stage 2 p + 1 is done
        barrier_sync(kTile1Free, kThreads);
        load_tile(2 * p + 3);
      }
      cp_async_commit();
      run_max[0] = m1[0], run_max[1] = m1[1];
    }
  }
  cp_async_wait<0>();

  const int head[2] = {head0 + row0, head0 + row1};
  const int64_t out_row[2] = {head[0] < a.heads ? r : -1, head[1] < a.heads ? r : -1};
  write_warpgroup_rows(a, part, split, splits, {wg, lane, row0, row1, c2}, out, run_sum, run_max, red_sum, head,
                       out_row);
#endif
}

}  // namespace

void launch_seesaw_decode(const TcDecodeArgs& a, void* workspace, dim3 grid, int inner_head_blocks,
                          cudaStream_t stream) {
  static std::once_flag attribute_set;
  std::call_once(attribute_set, [] {
    MOELINK_CUDA_CHECK(cudaFuncSetAttribute(seesaw_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kSmemBytes)));
  });
  seesaw_decode_kernel<<<grid, kThreads, kSmemBytes, stream>>>(a, workspace, inner_head_blocks);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::attention
