// The end of a warpgroup decode block (mla_decode_wgmma.cu's lockstep
// kernel and mla_decode_seesaw.cu's out-of-step one): both keep a 64-row x
// 512-dim output as two warpgroups' m64n256 accumulators (warpgroup wg
// dims 256 wg ..), each thread two rows of it.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/cuda/mla_decode_split.cuh"
#include "attention/cuda/mla_decode_tc.h"

namespace moelink::detail::attention::decode {

// A thread's place in the accumulators: its warpgroup, lane, rows (MMA rows
// row0 and row0 + 8) and first column pair.
struct WarpgroupRows {
  int wg, lane, row0, row1, c2;
};

// Row sums (this thread's share -> its quad's -> both warpgroups', through
// red_sum [2][64] in shared memory; a block-wide barrier), then this
// thread's two rows normalized: to out_latent [head, row] in bf16 (one
// split) or, with their log2-sum-exp (run_max in log2 units), to the split's
// partials. head[h] / out_row[h]: the head and decode row of MMA row h
// (out_row < 0: nothing to write).
__device__ __forceinline__ void write_warpgroup_rows(const TcDecodeArgs& a, const Partials& part, int split,
                                                     int splits, const WarpgroupRows& t, const float (&out)[128],
                                                     float (&run_sum)[2], const float (&run_max)[2],
                                                     float* red_sum, const int (&head)[2],
                                                     const int64_t (&out_row)[2]) {
  constexpr int kHeads = 64, kLatent = 512;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    run_sum[h] += __shfl_xor_sync(0xffffffffu, run_sum[h], 1);
    run_sum[h] += __shfl_xor_sync(0xffffffffu, run_sum[h], 2);
  }
  if (t.lane % 4 == 0) {
    red_sum[t.wg * kHeads + t.row0] = run_sum[0];
    red_sum[t.wg * kHeads + t.row1] = run_sum[1];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = h == 0 ? t.row0 : t.row1;
    if (out_row[h] < 0) continue;
    const float total = red_sum[row] + red_sum[kHeads + row];
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const int64_t slot = static_cast<int64_t>(head[h]) * a.Nd + out_row[h];  // out_latent's [head, row]
    const int64_t pslot = (static_cast<int64_t>(split) * a.Nd + out_row[h]) * a.heads + head[h];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int d = t.wg * 256 + j * 8 + t.c2;
      const float v0 = out[4 * j + 2 * h] * inv, v1 = out[4 * j + 2 * h + 1] * inv;
      if (splits == 1) {
        *reinterpret_cast<uint32_t*>(a.out_latent + slot * kLatent + d) = pack_bf16(v0, v1);
      } else {
        part.out[pslot * kLatent + d] = v0;
        part.out[pslot * kLatent + d + 1] = v1;
      }
    }
    if (splits > 1 && t.wg == 0 && t.lane % 4 == 0)
      part.lse[pslot] = total > 0.0f ? run_max[h] + log2f(total) : -INFINITY;
  }
}

}  // namespace moelink::detail::attention::decode
