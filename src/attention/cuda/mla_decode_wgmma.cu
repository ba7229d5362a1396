// moelink's MLA decode on Hopper's warpgroup MMAs (wgmma, sm_90a), for
// DeepSeek-V3's cache rows (latent 512 + rotary 64): the "moelink" decode
// of CudaAttentionOps where it applies (else mla_decode_tc.cu's mma.sync
// kernel).
//
// A block takes 64 MMA rows (wgmma's M), two warpgroups: 64 heads of one
// decode row, or with 32 heads or fewer 32 slots for each of a request's
// one or two decode rows (MTP's q_len 2 reads the keys once). Then:
//   Q [64 heads, 576] sits in shared memory for all of the block's keys;
//   keys stream in 64 a stage, cp.async two stages deep;
//   scores: warpgroup g scores the 64 heads against keys 32 g .. 32 g + 31
//     of the stage (m64n32k16, 36 K steps, A = Q and B = the keys, both
//     from shared memory);
//   softmax: row maxima exchanged through shared memory (both warpgroups
//     then rescale by the same maximum), probabilities to a shared P tile
//     (bf16), each thread's share of the row sums kept in registers until
//     the end;
//   P V: warpgroup g accumulates output dims 256 g .. 256 g + 255 over the
//     stage's 64 keys (m64n256k16, A = P, B = the keys' latent dims read
//     as an MN-major operand: the stage serves as keys and as values, no
//     transposed copy).
// Tiles in shared memory use wgmma's 128-byte swizzle: a row of 576 dims is
// 9 atoms of 64 dims, and an atom block holds 64 rows x 128 bytes, chunk c
// of row r at chunk c ^ (r % 8). Splits of a row's keys (grid.z) and their
// merge are mla_decode_tc.cu's (mla_decode_split.cuh).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "attention/cuda/mla_decode_split.cuh"
#include "attention/cuda/mla_decode_tc.h"
#include "attention/cuda/mla_decode_wgmma_rows.cuh"
#include "attention/cuda/wgmma.cuh"
#include "core/arg_checks.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {
namespace {

using namespace decode;
using namespace wgmma;

constexpr int kHeads = 64;                       // a block's heads: wgmma's M
constexpr int kLatent = 512, kRow = kLatent + kRope;
constexpr int kAtoms = kRow / 64;                // 64-dim swizzle atoms of a row
constexpr int kChunks = kRow / 8;                // 16-byte pieces of a row
constexpr int kThreads = 256;                    // two warpgroups
constexpr uint32_t kTile = kAtoms * kAtomBlock;  // 64 rows x 576 dims: 72 KB
constexpr uint32_t kPTile = kAtomBlock;          // 64 heads x 64 keys of P
constexpr uint32_t kRedBytes = 2 * 2 * kHeads * 4;  // row maxima and sums, a row per warpgroup
// Q, two stages of keys, P, the reductions, and room to align to 1024 bytes
// (the swizzle's period, which the MMA descriptors assume).
constexpr size_t kSmemBytes = 3 * size_t(kTile) + kPTile + kRedBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "past a Hopper block's shared memory");

// ------------------------------------------------------------ the kernel

// kOverlap: stage t + 1's scores issued behind stage t's P V (an A/B
// candidate, MOELINK_MLA_DECODE_OVERLAP=1: on an H100, 2026-12-06, 2-3 %
// slower than without, so off).
template <bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_kernel(TcDecodeArgs a, void* workspace,
                                                                   int inner_head_blocks) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's (wgmma_decode_applies asks for a Hopper GPU)
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint32_t q_tile = base, kv_tiles = base + kTile, p_tile = base + 3 * kTile;
  float* red_max = reinterpret_cast<float*>(smem_raw + (p_tile + kPTile - raw));  // [2 warpgroups][64 heads]
  float* red_sum = red_max + 2 * kHeads;                                          // [2 warpgroups][64 heads]

  // The block's 64 MMA rows ("slots"). More than 32 heads: 64 heads of
  // decode row blockIdx.x. 32 or fewer: 32 slots a query row, for both rows
  // of an MTP request (its keys streamed once for q_len 2): slot s is head
  // s % 32 of the request's row s / 32, and the block of its second row
  // leaves the request to the first's.
  // inner_head_blocks > 0 (the default): blockIdx.x = row x head blocks +
  // head block, so a row's head blocks run side by side and the second
  // reads the row's keys from L2 (128 requests of 128 heads, kv 5000, on an
  // H100: 548 -> 529 us); else blockIdx.x is the row, blockIdx.y the head
  // block, and every row's first head block runs before any second one.
  const int64_t r = inner_head_blocks > 0 ? blockIdx.x / inner_head_blocks : blockIdx.x;
  const int64_t decode_rows = a.plan.decode_rows[0];
  const int head_block = inner_head_blocks > 0 ? blockIdx.x % inner_head_blocks : blockIdx.y;
  const int split = blockIdx.z, splits = gridDim.z;
  if (r >= decode_rows) return;
  const int32_t request = a.plan.request[r];
  const bool packed = a.heads <= kHeads / 2;
  const int per_row = packed ? kHeads / 2 : kHeads, head0 = packed ? 0 : head_block * kHeads;
  if (packed && request >= 0 && r > 0 && a.plan.request[r - 1] == request) return;  // the first row's block
  const int rows = packed && request >= 0 && r + 1 < decode_rows && a.plan.request[r + 1] == request ? 2 : 1;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  // A thread's accumulator rows (slots) and first column.
  const int row0 = (tid % 128) / 32 * 16 + lane / 4, row1 = row0 + 8, c2 = (lane % 4) * 2;
  // A slot's query row (-1: none, its scores computed and never stored) and head.
  auto slot_row = [&](int slot) -> int64_t {
    const int q = slot / per_row;
    return q < rows && head0 + slot % per_row < a.heads ? r + q : -1;
  };
  auto slot_head = [&](int slot) { return head0 + slot % per_row; };
  if (request < 0) {  // a row the plan skips: zeros (the merge writes them when split)
    if (splits == 1) zero_skipped_row(a.out_latent, a.Nd, r, head0, per_row, a.heads, kLatent, tid, kThreads);
    return;
  }
  // Keys of the block: its last row's (each slot masked to its own row's).
  const int64_t keys = static_cast<int64_t>(a.plan.position[r + rows - 1]) + 1;
  const KeyRange range = split_keys(keys, split, splits);
  const Partials part = partials_of(workspace, splits, a.Nd, a.heads, kLatent);
  if (range.begin >= range.end) {  // an empty split: -inf for each slot's row and head
    for (int q = 0; q < rows; ++q) mark_empty_split(part, a.Nd, split, r + q, head0, per_row, a.heads, tid);
    return;
  }
  int64_t key_end[2];  // the thread's two slots: their keys end here (their rows' positions + 1)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = slot_row(h == 0 ? row0 : row1);
    key_end[h] = row < 0 ? range.end : std::min<int64_t>(range.end, a.plan.position[row] + 1);
  }

  // Each thread moves 18 pieces of one row (4 threads a row): the queries
  // of slot tid / 4 (latent, then rotary), and a stage's key tid / 4.
  const int my_row = tid / 4, first_piece = tid % 4;
  {
    const int64_t row = slot_row(my_row);
    const int h = slot_head(my_row);
    const bool valid = row >= 0;  // other slots: zeros
    const uint16_t* latent = a.q_latent + (static_cast<int64_t>(h) * a.Nd + row) * kLatent;
    const uint16_t* rotary = a.q + row * a.q_stride + static_cast<int64_t>(h) * a.head_dim + a.nope_dims;
#pragma unroll
    for (int m = 0; m < kChunks / 4; ++m) {
      const int c = first_piece + 4 * m;
      const uint16_t* src = c < kLatent / 8 ? latent + c * 8 : rotary + (c - kLatent / 8) * 8;
      cp_async_16(q_tile + tile_offset(my_row, c), valid ? src : a.q_latent, valid);
    }
  }
  const int32_t* block_row = a.block_table + static_cast<int64_t>(request) * a.block_stride;
  // Stage `stage` <- cache rows of keys [key0, key0 + 64); keys past the
  // range read as zeros (their scores are masked).
  auto load_stage = [&](int stage, int64_t key0) {
    const int64_t s = key0 + my_row;
    const bool valid = s < range.end;
    const uint16_t* src =
        valid ? a.cache + (static_cast<int64_t>(block_row[s / a.page_size]) * a.page_size + s % a.page_size) * kRow
              : a.cache;
    const uint32_t dst = kv_tiles + stage * kTile;
#pragma unroll
    for (int m = 0; m < kChunks / 4; ++m) {
      const int c = first_piece + 4 * m;
      cp_async_16(dst + tile_offset(my_row, c), src + (valid ? c * 8 : 0), valid);
    }
  };

  float out[128];  // rows row0 / row1, dims 256 wg + 8 j + c2 (+1): out[4 j + {0, 1}] / out[4 j + {2, 3}]
#pragma unroll
  for (int i = 0; i < 128; ++i) out[i] = 0.0f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // log2 domain; this thread's share
  const float scale = a.scale * kLog2e;
  const int stages = static_cast<int>((range.end - range.begin + kKeysPerStage - 1) / kKeysPerStage);

  float sc[16];  // scores: rows row0 / row1, keys 32 wg + 8 j + c2 (+1) of the stage
  // Issues the scores of keys 32 wg .. 32 wg + 31 of a stage (one group).
  auto issue_scores = [&](uint32_t stage) {
#pragma unroll
    for (int i = 0; i < 16; ++i) sc[i] = 0.0f;
    fence_registers(sc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kRow / 16; ++k) {
      const uint32_t in_atom = (k % 4) * 32;  // a K step's 16 dims within the 128-byte row
      const uint64_t qa = smem_desc(q_tile + (k / 4) * kAtomBlock + in_atom, 16, 1024);
      const uint64_t kb = smem_desc(stage + (k / 4) * kAtomBlock + wg * 32 * 128 + in_atom, 16, 1024);
      mma_64x32_ss(sc, qa, kb);
    }
    wgmma_commit();
  };
  // The scores of stage t (landed in sc) to probabilities in P; the row
  // maxima, sums and outputs rescaled. Ends with P whole (a barrier).
  auto softmax_to_p = [&](int t) {
    // Scaled into log2 units; keys past each slot's end masked; this stage's row maxima.
    const int64_t key0 = range.begin + static_cast<int64_t>(t) * kKeysPerStage + wg * 32 + c2;
    float tile_max[2];
    scale_mask_max<4>(sc, key0, key_end, scale, tile_max);
    if (lane % 4 == 0) {
      red_max[wg * kHeads + row0] = tile_max[0];
      red_max[wg * kHeads + row1] = tile_max[1];
    }
    __syncthreads();
    float base_max[2], correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = h == 0 ? row0 : row1;
      const float m = fmaxf(run_max[h], fmaxf(red_max[row], red_max[kHeads + row]));
      base_max[h] = m == -INFINITY ? 0.0f : m;  // no key yet: exp2(-inf) = 0 everywhere
      correction[h] = exp2f(run_max[h] - base_max[h]);
      run_max[h] = m;
      run_sum[h] *= correction[h];
    }
    // Probabilities into P (bf16), this thread's share of the row sums.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = exp2f(sc[4 * j] - base_max[0]), p1 = exp2f(sc[4 * j + 1] - base_max[0]);
      const float p2 = exp2f(sc[4 * j + 2] - base_max[1]), p3 = exp2f(sc[4 * j + 3] - base_max[1]);
      run_sum[0] += p0 + p1;
      run_sum[1] += p2 + p3;
      const int col = wg * 32 + j * 8 + c2;  // a key of the stage: piece col / 8 of P's row
      const uint32_t in_piece = (col % 8) * 2;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_tile + tile_offset(row0, col / 8) + in_piece),
                   "r"(pack_bf16(p0, p1)));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_tile + tile_offset(row1, col / 8) + in_piece),
                   "r"(pack_bf16(p2, p3)));
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      out[4 * j] *= correction[0];
      out[4 * j + 1] *= correction[0];
      out[4 * j + 2] *= correction[1];
      out[4 * j + 3] *= correction[1];
    }
    fence_proxy_async();
    __syncthreads();  // P whole
  };
  // Issues out += P (64 slots x 64 keys) . V (64 keys x this warpgroup's 256 dims) (one group).
  auto issue_values = [&](uint32_t stage) {
    fence_registers(out);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKeysPerStage / 16; ++k) {
      const uint64_t pa = smem_desc(p_tile + k * 32, 16, 1024);
      const uint64_t vb = smem_desc(stage + wg * 4 * kAtomBlock + k * 16 * 128, kAtomBlock, 1024);
      mma_64x256_ss(out, pa, vb);
    }
    wgmma_commit();
  };
  auto stage_tile = [&](int t) { return kv_tiles + (t & 1) * kTile; };

  if constexpr (!kOverlap) {
    // Each stage's phases one after the other; stage t + 1 loads meanwhile.
    if (stages > 0) load_stage(0, range.begin);
    cp_async_commit();  // the queries and stage 0
    for (int t = 0; t < stages; ++t) {
      if (t + 1 < stages) load_stage((t + 1) & 1, range.begin + static_cast<int64_t>(t + 1) * kKeysPerStage);
      cp_async_commit();
      cp_async_wait<1>();  // stage t (and, at t = 0, the queries) landed
      fence_proxy_async();
      __syncthreads();
      issue_scores(stage_tile(t));
      wgmma_wait<0>();
      fence_registers(sc);
      softmax_to_p(t);
      issue_values(stage_tile(t));
      wgmma_wait<0>();
      fence_registers(out);
      __syncthreads();  // the stage's buffer, P and the maxima are free for the next
    }
  } else {
    // Stage t + 1's scores issued behind stage t's P V, so the tensor cores
    // go from one to the other; stage t + 2 loads once stage t's P V is done.
    if (stages > 0) load_stage(0, range.begin);
    cp_async_commit();  // the queries and stage 0
    if (stages > 1) load_stage(1, range.begin + kKeysPerStage);
    cp_async_commit();
    if (stages > 0) {
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      issue_scores(stage_tile(0));
      wgmma_wait<0>();
      fence_registers(sc);
    }
    for (int t = 0; t < stages; ++t) {
      softmax_to_p(t);
      issue_values(stage_tile(t));
      if (t + 1 < stages) {
        cp_async_wait<0>();  // stage t + 1 landed
        fence_proxy_async();
        __syncthreads();
        issue_scores(stage_tile(t + 1));
        wgmma_wait<1>();  // stage t's P V done (stage t + 1's scores may run on)
        fence_registers(out);
        __syncthreads();  // every warpgroup's: stage t's buffer and P are free
        if (t + 2 < stages) load_stage(t & 1, range.begin + static_cast<int64_t>(t + 2) * kKeysPerStage);
        cp_async_commit();
        wgmma_wait<0>();
        fence_registers(sc);
      } else {
        wgmma_wait<0>();
        fence_registers(out);
      }
    }
  }
  cp_async_wait<0>();

  const int head[2] = {slot_head(row0), slot_head(row1)};
  const int64_t out_row[2] = {slot_row(row0), slot_row(row1)};
  write_warpgroup_rows(a, part, split, splits, {wg, lane, row0, row1, c2}, out, run_sum, run_max, red_sum, head,
                       out_row);
#endif
}

int compute_capability() {
  int device = 0, major = 0, minor = 0;
  MOELINK_CUDA_CHECK(cudaGetDevice(&device));
  MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

}  // namespace

bool wgmma_decode_applies(const TcDecodeArgs& a) {
  static const bool hopper = compute_capability() == 90;  // sm_90a code only
  const bool aligned = ((reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.q_latent) |
                         reinterpret_cast<uintptr_t>(a.cache) | static_cast<uintptr_t>(a.q_stride * 2) |
                         static_cast<uintptr_t>(a.head_dim * 2) | static_cast<uintptr_t>(a.nope_dims * 2)) %
                        16) == 0;
  return hopper && aligned && a.R == kLatent && a.head_dim - a.nope_dims == kRope && a.heads >= 1;
}

constexpr int64_t kSeesawMinRows = 32;

int wgmma_decode_head_blocks(const TcDecodeArgs& a) { return (a.heads + kHeads - 1) / kHeads; }

void launch_wgmma_decode(const TcDecodeArgs& a, void* workspace, int splits, cudaStream_t stream) {
  static const bool overlap = env_int("MOELINK_MLA_DECODE_OVERLAP", 0, 0, 1) == 1;
  static std::once_flag attribute_set;
  std::call_once(attribute_set, [] {
    for (const void* kernel : {reinterpret_cast<const void*>(wgmma_decode_kernel<false>),
                               reinterpret_cast<const void*>(wgmma_decode_kernel<true>)})
      MOELINK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kSmemBytes)));
  });
  static const bool heads_inner = env_int("MOELINK_MLA_DECODE_HEADS_INNER", 1, 0, 1) == 1;
  // MOELINK_MLA_DECODE_SEESAW=0 / 1: never / always the out-of-step kernel
  // where it applies; unset: from kSeesawMinRows decode rows (on an H100,
  // 128 heads, kv 5000: 155 / 470 us against 167 / 531 at 32 / 128 rows,
  // 51 against 49 at one; 153 / 449 us since its own-stage-first order;
  // docs/attention.md).
  static const int seesaw = env_int("MOELINK_MLA_DECODE_SEESAW", -1, 0, 1);
  const int head_blocks = wgmma_decode_head_blocks(a);
  const dim3 grid(static_cast<unsigned>(a.rows_bound * (heads_inner ? head_blocks : 1)),
                  static_cast<unsigned>(heads_inner ? 1 : head_blocks), static_cast<unsigned>(splits));
  const int inner = heads_inner ? head_blocks : 0;
  const bool out_of_step = seesaw == 1 || (seesaw < 0 && a.rows_bound >= kSeesawMinRows);
  if (out_of_step && seesaw_decode_applies(a))
    launch_seesaw_decode(a, workspace, grid, inner, stream);
  else if (overlap)
    wgmma_decode_kernel<true><<<grid, kThreads, kSmemBytes, stream>>>(a, workspace, inner);
  else
    wgmma_decode_kernel<false><<<grid, kThreads, kSmemBytes, stream>>>(a, workspace, inner);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::attention
