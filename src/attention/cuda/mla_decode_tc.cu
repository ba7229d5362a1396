#include "attention/cuda/mla_decode_tc.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "attention/cuda/mla_decode_split.cuh"
#include "attention/decode_splits.h"
#include "core/arg_checks.h"
#include "moelink/errors.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {
namespace {

using namespace decode;

constexpr int kHeadsPerGroup = 16;  // the MMAs' M: the heads of a group of warps
constexpr int kWarps = 4;           // a group's: each 16 keys of the scores, R / 4 dims of the output
constexpr int kPad = 8;             // bf16 elements after each shared-memory row: ldmatrix rows in distinct banks

// The shapes of one instantiation: R latent dims, G groups of 4 warps a
// block (each group 16 heads against the same stages of keys).
template <int R, int G>
struct Shape {
  static constexpr int kHeads = G * kHeadsPerGroup;     // a block's heads
  static constexpr int kThreads = G * kWarps * 32;
  static constexpr int kDc = R + kRope;                 // a cache row: keys over all of it, values its first R
  static constexpr int kRow = kDc + kPad;               // a cache row's stride in shared memory
  static constexpr int kKSteps = kDc / 16;              // K steps of the score MMAs
  static constexpr int kDimsPerWarp = R / kWarps;       // output dims a warp accumulates
  static constexpr int kNTiles = kDimsPerWarp / 8;      // its n8 accumulator tiles
  static constexpr int kChunks = kDc / 8;               // 16-byte pieces of a cache row
  static constexpr int kPRow = kKeysPerStage + kPad;    // a probability row's stride
  static constexpr size_t kQElems = size_t(kHeads) * kRow;
  static constexpr size_t kKElems = size_t(kKeysPerStage) * kRow;  // one stage
  static constexpr size_t kPElems = size_t(kHeads) * kPRow;
  static constexpr size_t kRed = size_t(G) * kWarps * kHeadsPerGroup;  // one reduction's floats
  static constexpr size_t kSmemBytes = (kQElems + 2 * kKElems + kPElems) * 2 + 2 * kRed * 4;
  static_assert(R % 64 == 0 && kDimsPerWarp % 16 == 0, "R must be a multiple of 64");
};

// ------------------------------------------------------------ PTX pieces

// Four 8x8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a (16 x 16, row-major) . b (16 x 8, column-major), fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------ the kernel

template <int R, int G>
__global__ void __launch_bounds__(Shape<R, G>::kThreads) tc_decode_kernel(TcDecodeArgs a, void* workspace) {
  using S = Shape<R, G>;
  constexpr int kThreads = S::kThreads;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* qs = smem;                        // [G x 16 heads][kRow]
  uint16_t* ks = qs + S::kQElems;             // [2 stages][64 keys][kRow]
  uint16_t* ps = ks + 2 * S::kKElems;         // [G x 16 heads][kPRow]: this stage's probabilities
  float* red_max = reinterpret_cast<float*>(ps + S::kPElems);  // [G][kWarps][16]
  float* red_sum = red_max + S::kRed;                          // [G][kWarps][16]

  const int64_t r = blockIdx.x;
  const int block_h0 = blockIdx.y * S::kHeads, split = blockIdx.z, splits = gridDim.z;
  if (r >= a.plan.decode_rows[0]) return;
  const int32_t request = a.plan.request[r];
  const int tid = threadIdx.x, lane = tid % 32;
  // This warp's group (its 16 heads, from h0) and its place in the group.
  const int group = tid / 32 / kWarps, warp = tid / 32 % kWarps;
  const int h0 = block_h0 + group * kHeadsPerGroup;
  const int g = lane / 4, c2 = (lane % 4) * 2;  // an accumulator's row (and row + 8) and first column
  if (request < 0) {  // a row the plan skips: zeros (the merge writes them when split)
    if (splits == 1) zero_skipped_row(a.out_latent, a.Nd, r, block_h0, S::kHeads, a.heads, R, tid, kThreads);
    return;
  }
  const int64_t keys = static_cast<int64_t>(a.plan.position[r]) + 1;
  const KeyRange range = split_keys(keys, split, splits);
  const Partials part = partials_of(workspace, splits, a.Nd, a.heads, R);
  if (range.begin >= range.end) return mark_empty_split(part, a.Nd, split, r, block_h0, S::kHeads, a.heads, tid);

  // This block's queries: 16 heads x [latent R | rotary 64]; heads past
  // `heads` are zeros (their scores are computed, never stored). 16-byte
  // pieces through cp.async in the first stage's group (a loop of 2-byte
  // loads waited for each: about 50 us a block on an H100), else elements.
  auto query = [&](int h, int d) {
    return d < R ? a.q_latent + (static_cast<int64_t>(h) * a.Nd + r) * R + d
                 : a.q + r * a.q_stride + static_cast<int64_t>(h) * a.head_dim + a.nope_dims + (d - R);
  };
  const bool q_pieces = ((reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.q_latent) |
                          static_cast<uintptr_t>(a.q_stride * 2) | static_cast<uintptr_t>(a.head_dim * 2) |
                          static_cast<uintptr_t>(a.nope_dims * 2)) % 16) == 0;
  if (q_pieces) {
    for (int i = tid; i < S::kHeads * S::kChunks; i += kThreads) {
      const int hh = i / S::kChunks, d = (i % S::kChunks) * 8, h = block_h0 + hh;
      cp_async_16(smem_addr(qs + hh * S::kRow + d), h < a.heads ? query(h, d) : a.q_latent, h < a.heads);
    }
  } else {
    for (int i = tid; i < S::kHeads * S::kDc; i += kThreads) {
      const int hh = i / S::kDc, d = i % S::kDc, h = block_h0 + hh;
      qs[hh * S::kRow + d] = h < a.heads ? *query(h, d) : uint16_t{0};
    }
  }

  const int32_t* block_row = a.block_table + static_cast<int64_t>(request) * a.block_stride;
  // Stage `stage` <- cache rows of keys [key0, key0 + 64); keys past the
  // range read as zeros (their scores are masked).
  auto load_stage = [&](int stage, int64_t key0) {
    uint16_t* dst = ks + stage * S::kKElems;
    for (int i = tid; i < kKeysPerStage * S::kChunks; i += kThreads) {
      const int k = i / S::kChunks, piece = i % S::kChunks;
      const int64_t s = key0 + k;
      const bool valid = s < range.end;
      const uint16_t* src = a.cache;
      if (valid)
        src += (static_cast<int64_t>(block_row[s / a.page_size]) * a.page_size + s % a.page_size) * S::kDc +
               piece * 8;
      cp_async_16(smem_addr(dst + k * S::kRow + piece * 8), src, valid);
    }
  };

  float acc[S::kNTiles][4];
  for (int n = 0; n < S::kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // rows g and g + 8 (log2 domain)
  const float scale = a.scale * kLog2e;
  const int stages = static_cast<int>((range.end - range.begin + kKeysPerStage - 1) / kKeysPerStage);

  if (stages > 0) load_stage(0, range.begin);
  cp_async_commit();
  for (int t = 0; t < stages; ++t) {
    if (t + 1 < stages) load_stage((t + 1) & 1, range.begin + static_cast<int64_t>(t + 1) * kKeysPerStage);
    cp_async_commit();
    cp_async_wait<1>();  // stage t has landed (and, at t = 0, the queries were stored)
    __syncthreads();
    const uint16_t* kt = ks + (t & 1) * S::kKElems;

    // Scores of this warp's 16 keys: two n8 tiles.
    float sc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    {
      const int q = lane / 8, i8 = lane % 8;
      const uint16_t* a_row = qs + (group * kHeadsPerGroup + (q & 1) * 8 + i8) * S::kRow + (q >> 1) * 8;
      const uint16_t* b_row = kt + (warp * 16 + (q >> 1) * 8 + i8) * S::kRow + (q & 1) * 8;
#pragma unroll 4
      for (int kk = 0; kk < S::kKSteps; ++kk) {
        uint32_t af[4], bf[4];
        ldmatrix_x4(af, a_row + kk * 16);
        ldmatrix_x4(bf, b_row + kk * 16);
        mma_16816(sc[0], af, bf[0], bf[1]);
        mma_16816(sc[1], af, bf[2], bf[3]);
      }
    }
    // Scaled into log2 units; keys past the range masked.
    const int64_t key_base = range.begin + static_cast<int64_t>(t) * kKeysPerStage + warp * 16 + c2;
    const int64_t end[2] = {range.end, range.end};
    float tile_max[2];
    scale_mask_max<2>(&sc[0][0], key_base, end, scale, tile_max);
    if (lane % 4 == 0) {
      red_max[(group * kWarps + warp) * kHeadsPerGroup + g] = tile_max[0];
      red_max[(group * kWarps + warp) * kHeadsPerGroup + g + 8] = tile_max[1];
    }
    __syncthreads();
    float new_max[2], correction[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = run_max[h];
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red_max[(group * kWarps + w) * kHeadsPerGroup + g + 8 * h]);
      new_max[h] = m;
      base[h] = m == -INFINITY ? 0.0f : m;  // no key yet: exp2(-inf) = 0 everywhere
      correction[h] = exp2f(run_max[h] - base[h]);
    }
    // Probabilities (bf16, for P V) and this warp's part of their sums.
    float part_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float p0 = exp2f(sc[j][0] - base[0]), p1 = exp2f(sc[j][1] - base[0]);
      const float p2 = exp2f(sc[j][2] - base[1]), p3 = exp2f(sc[j][3] - base[1]);
      part_sum[0] += p0 + p1;
      part_sum[1] += p2 + p3;
      const int col = warp * 16 + j * 8 + c2;
      uint16_t* p_rows = ps + group * kHeadsPerGroup * S::kPRow;
      *reinterpret_cast<uint32_t*>(p_rows + g * S::kPRow + col) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(p_rows + (g + 8) * S::kPRow + col) = pack_bf16(p2, p3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 1);
      part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 2);
    }
    if (lane % 4 == 0) {
      red_sum[(group * kWarps + warp) * kHeadsPerGroup + g] = part_sum[0];
      red_sum[(group * kWarps + warp) * kHeadsPerGroup + g + 8] = part_sum[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = 0.0f;
      for (int w = 0; w < kWarps; ++w) s += red_sum[(group * kWarps + w) * kHeadsPerGroup + g + 8 * h];
      run_sum[h] = run_sum[h] * correction[h] + s;
      run_max[h] = new_max[h];
    }
#pragma unroll
    for (int n = 0; n < S::kNTiles; ++n) {
      acc[n][0] *= correction[0];
      acc[n][1] *= correction[0];
      acc[n][2] *= correction[1];
      acc[n][3] *= correction[1];
    }
    // acc += P (16 x 64) . V (64 keys x this warp's R / 4 dims).
    {
      const int q = lane / 8, i8 = lane % 8;
      const int dim0 = warp * S::kDimsPerWarp;
#pragma unroll
      for (int ks16 = 0; ks16 < kKeysPerStage / 16; ++ks16) {
        uint32_t af[4];
        ldmatrix_x4(af, ps + (group * kHeadsPerGroup + (q & 1) * 8 + i8) * S::kPRow + ks16 * 16 + (q >> 1) * 8);
        const uint16_t* v_row = kt + (ks16 * 16 + (q & 1) * 8 + i8) * S::kRow + dim0 + (q >> 1) * 8;
#pragma unroll
        for (int n2 = 0; n2 < S::kNTiles / 2; ++n2) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, v_row + n2 * 16);
          mma_16816(acc[2 * n2], af, bf[0], bf[1]);
          mma_16816(acc[2 * n2 + 1], af, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // this stage's buffer, P and the sums are free for the next
  }
  cp_async_wait<0>();

  // The outputs of rows g and g + 8, normalized; split: with their log-sum-exp.
  const float inv[2] = {run_sum[0] > 0.0f ? 1.0f / run_sum[0] : 0.0f,
                        run_sum[1] > 0.0f ? 1.0f / run_sum[1] : 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = h0 + g + 8 * h;
    if (head >= a.heads) continue;
    const int64_t slot = static_cast<int64_t>(head) * a.Nd + r;  // out_latent's [head, row]
    const int64_t pslot = (static_cast<int64_t>(split) * a.Nd + r) * a.heads + head;
#pragma unroll
    for (int n = 0; n < S::kNTiles; ++n) {
      const int d = warp * S::kDimsPerWarp + n * 8 + c2;
      const float v0 = acc[n][2 * h] * inv[h], v1 = acc[n][2 * h + 1] * inv[h];
      if (splits == 1) {
        *reinterpret_cast<uint32_t*>(a.out_latent + slot * R + d) = pack_bf16(v0, v1);
      } else {
        part.out[pslot * R + d] = v0;
        part.out[pslot * R + d + 1] = v1;
      }
    }
    if (splits > 1 && warp == 0 && lane % 4 == 0)
      part.lse[pslot] = run_sum[h] > 0.0f ? run_max[h] + log2f(run_sum[h]) : -INFINITY;
  }
}

// The splits of each (row, head) merged: out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m).
__global__ void tc_decode_merge_kernel(TcDecodeArgs a, const void* workspace, int splits) {
  const int64_t r = blockIdx.x;
  const int head = blockIdx.y;
  if (r >= a.plan.decode_rows[0]) return;
  uint16_t* out = a.out_latent + (static_cast<int64_t>(head) * a.Nd + r) * a.R;
  if (a.plan.request[r] < 0) {
    for (int d = threadIdx.x; d < a.R; d += blockDim.x) out[d] = 0;
    return;
  }
  const Partials part = partials_of(const_cast<void*>(workspace), splits, a.Nd, a.heads, a.R);
  auto slot = [&](int s) { return (static_cast<int64_t>(s) * a.Nd + r) * a.heads + head; };
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, part.lse[slot(s)]);
  float weights[kMaxSplits];
  float total = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float l = part.lse[slot(s)];
    weights[s] = l == -INFINITY ? 0.0f : exp2f(l - m);  // a split without keys: its outputs are never read
    total += weights[s];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < a.R; d += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < splits; ++s)
      if (weights[s] > 0.0f) v += weights[s] * part.out[slot(s) * a.R + d];
    out[d] = to_bf16_bits(v * inv);
  }
}

int sm_count() {
  int device = 0, count = 0;
  MOELINK_CUDA_CHECK(cudaGetDevice(&device));
  MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Groups of 4 warps a block: 2 (32 heads against each stage of keys: half
// the key traffic, twice the warps a multiprocessor) where more than 16
// heads run, else 1; MOELINK_MLA_TC_GROUPS=1 keeps one (the A/B of
// 2026-12-06 on an H100, 128 heads, kv 5000: 2 groups 69 / 566 / 2145 us at
// batch 1 / 32 / 128 against 72 / 1396 / 5634 us with one).
int groups_for(const TcDecodeArgs& a) {
  static const int asked = env_int("MOELINK_MLA_TC_GROUPS", 2, 1, 2);
  return a.heads > kHeadsPerGroup ? asked : 1;
}

// Whether the warpgroup-MMA kernel runs these arguments.
bool use_wgmma(const TcDecodeArgs& a) {
#if defined(MOELINK_WGMMA_DECODE)
  static const bool on = env_int("MOELINK_MLA_DECODE_WGMMA", 1, 0, 1) == 1;
  return on && wgmma_decode_applies(a);
#else
  (void)a;
  return false;
#endif
}

// Stages of keys a split of the warpgroup kernel takes at least: a block
// loads its 72 KB of queries and fills its pipeline once, and every split
// adds partials to write and merge (at one request of 128 heads, 66 splits
// wrote 17 MB of them). MOELINK_MLA_DECODE_SPLIT_STAGES sets it (A/B runs).
int64_t min_split_stages() {
  static const int64_t v = env_int("MOELINK_MLA_DECODE_SPLIT_STAGES", 4, 1, kMaxSplits);
  return v;
}

// Splits of each row's keys. The warpgroup kernel: decode_splits
// (attention/decode_splits.h), the cheapest count in waves of its grid's
// blocks (one a multiprocessor), measured on an H100 (2026-12-06, 128
// heads, kv 5000: 8 requests 78 -> 70 us, the rest level);
// MOELINK_MLA_DECODE_SPLITS_BY_WAVES=0 turns it off. The mma.sync kernel
// (two blocks a multiprocessor; the waves rule unmeasured there), and the
// warpgroup kernel with the rule off: the fewest splits that give every
// slot a block of the grid.
int splits_for(const TcDecodeArgs& a) {
  const bool wgmma = use_wgmma(a);
  const int heads_per_block = wgmma ? 64 : groups_for(a) * kHeadsPerGroup;
  const int64_t head_blocks = (a.heads + heads_per_block - 1) / heads_per_block;
  DecodeSplitShape shape;
  shape.busy_one = std::max<int64_t>(1, (a.rows_bound + 1) / 2 * head_blocks);
  shape.busy_two = std::max<int64_t>(1, a.rows_bound * head_blocks);
  shape.stages = std::max<int64_t>(1, (a.max_keys + kKeysPerStage - 1) / kKeysPerStage);
  shape.slots = (wgmma ? 1 : 2) * static_cast<int64_t>(sm_count());
  shape.most = std::clamp<int64_t>(wgmma ? shape.stages / min_split_stages() : shape.stages, 1, kMaxSplits);
  static const bool by_waves = env_int("MOELINK_MLA_DECODE_SPLITS_BY_WAVES", 1, 0, 1) == 1;
  if (!(wgmma && by_waves)) return static_cast<int>(std::min((shape.slots + shape.busy_two - 1) / shape.busy_two, shape.most));
  return static_cast<int>(decode_splits(shape));
}

template <int R, int G>
void launch_for(const TcDecodeArgs& a, void* workspace, int splits, cudaStream_t stream) {
  using S = Shape<R, G>;
  static std::once_flag attribute_set;
  std::call_once(attribute_set, [] {
    MOELINK_CUDA_CHECK(cudaFuncSetAttribute(tc_decode_kernel<R, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(S::kSmemBytes)));
  });
  const dim3 grid(static_cast<unsigned>(a.rows_bound), static_cast<unsigned>((a.heads + S::kHeads - 1) / S::kHeads),
                  static_cast<unsigned>(splits));
  tc_decode_kernel<R, G><<<grid, S::kThreads, S::kSmemBytes, stream>>>(a, workspace);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

template <int R>
void launch_for(const TcDecodeArgs& a, void* workspace, int splits, cudaStream_t stream) {
  if (groups_for(a) == 2)
    launch_for<R, 2>(a, workspace, splits, stream);
  else
    launch_for<R, 1>(a, workspace, splits, stream);
}

}  // namespace

bool tc_decode_supported(int R, int rope_dims) {
  return rope_dims == kRope && (R == 128 || R == 256 || R == 512);
}

size_t tc_decode_workspace_bytes(const TcDecodeArgs& a) {
  if (a.rows_bound == 0 || a.heads == 0) return 0;
  const int splits = splits_for(a);
  if (splits == 1) return 0;
  return static_cast<size_t>(splits) * a.Nd * a.heads * (static_cast<size_t>(a.R) + 1) * sizeof(float);
}

void launch_tc_decode(const TcDecodeArgs& a, void* workspace, cudaStream_t stream) {
  if (!tc_decode_supported(a.R, a.head_dim - a.nope_dims))
    throw InvalidArgument("moelink: MLA decode (tensor cores): kv_lora_rank = " + std::to_string(a.R) +
                          " and qk_rope_head_dim = " + std::to_string(a.head_dim - a.nope_dims) +
                          " must be 128, 256 or 512 and 64");
  if (a.rows_bound < 0 || a.rows_bound > a.Nd)
    throw InvalidArgument("moelink: MLA decode (tensor cores): rows_bound = " + std::to_string(a.rows_bound) +
                          " must be in [0, " + std::to_string(a.Nd) + "] (the rows the buffers hold)");
  if (a.rows_bound == 0 || a.heads == 0) return;
  const int splits = splits_for(a);
  if (splits > 1 && workspace == nullptr)
    throw InvalidArgument("moelink: MLA decode (tensor cores): no workspace for " + std::to_string(splits) +
                          " key splits");
  if (use_wgmma(a)) {
    launch_wgmma_decode(a, workspace, splits, stream);
  } else {
    switch (a.R) {
      case 128: launch_for<128>(a, workspace, splits, stream); break;
      case 256: launch_for<256>(a, workspace, splits, stream); break;
      default: launch_for<512>(a, workspace, splits, stream); break;
    }
  }
  if (splits > 1) {
    tc_decode_merge_kernel<<<dim3(static_cast<unsigned>(a.rows_bound), static_cast<unsigned>(a.heads)), 128, 0,
                             stream>>>(
        a, workspace, splits);
    MOELINK_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace moelink::detail::attention
