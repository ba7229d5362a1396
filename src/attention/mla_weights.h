// MLAAttention's weights on the host, in the layout its GEMMs take: every
// projection as fp8 e4m3 with one fp32 scale per 128 x 128 block, this TP
// rank's heads only, q_a_proj and kv_a_proj_with_mqa merged into one matrix
// (qkv_a, the seed's merged projection), kv_b_proj's halves split per head
// for the absorbed decode (W_UK transposed, W_UV as is).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moelink/attention.h"

namespace moelink::detail::attention {

// A [rows, cols] fp8 matrix with [rows/128, cols/128] block scales; rows and
// cols are multiples of 128 (a projection of fewer rows is padded with
// zero rows).
struct BlockMatrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale;
  float& scale_at(int64_t block_row, int64_t block_col) { return scale[block_row * (cols / 128) + block_col]; }
};

BlockMatrix rows_of(const BlockMatrix& m, int64_t first, int64_t count);  // 128-aligned
BlockMatrix cols_of(const BlockMatrix& m, int64_t first, int64_t count);  // 128-aligned
BlockMatrix transposed(const BlockMatrix& m);
BlockMatrix stacked(const std::vector<const BlockMatrix*>& parts);  // rows of each, in order

struct HostMLAWeights {
  std::vector<float> input_layernorm;  // [D] or empty
  std::vector<float> q_a_layernorm;    // [Rq]
  std::vector<float> kv_a_layernorm;   // [R]
  BlockMatrix qkv_a;  // [Rq + ceil128(R + Dr), D]: q_a rows, kv_a rows, zero rows
  BlockMatrix q_b;    // [Hq (Dn + Dr), Rq]
  BlockMatrix kv_b;   // [Hq (Dn + Dv), R]: the prefill's expansion
  BlockMatrix w_uk_t; // [Hq R, Dn]: per head W_UK^T (q_nope -> latent)
  BlockMatrix w_uv;   // [Hq Dv, R]: per head W_UV (latent -> v)
  BlockMatrix o;      // [D, Hq Dv]
};

// Reads bytes of a tensor of the object's memory kind into host memory.
using CopyOut = std::function<void(void* dst, const void* src, size_t bytes)>;

// Checks every tensor of `w` (naming the field) and prepares this rank's
// weights. `call` names the public call in messages.
HostMLAWeights prepare_mla_weights(const char* call, const MLAWeights& w, const MLAConfig& c,
                                   int tp_size, int tp_rank, const CopyOut& copy_out);

}  // namespace moelink::detail::attention
