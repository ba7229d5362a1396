// Where everything of the NVSHMEM backend lives: the symmetric buffer (the
// same offsets on every PE, so a sender computes any destination address
// from its own base and the PE number) and the private per-rank state.
// Plain data shared by host and device code; the protocol is in
// docs/nvshmem.md.
#pragma once

#include <cstdint>

#include "core/layout.h"

namespace moelink::detail::shmem {

// First bytes of a dispatch chunk: the source token, then the token's k
// expert ids as the sender validated them (-1 for no route or a bad id), so
// the receiver of any of the token's experts finds its routes (an expert
// repeated in a token's top-k travels once and takes one row per route).
struct ChunkHeader {
  uint32_t token;  // t in the source DP group
  uint32_t reserved[3];
};
static_assert(sizeof(ChunkHeader) == 16);

// A route the dispatch receive half accepted (or dropped), in the order it
// was received; the combine send half walks this list.
struct CombineItem {
  int32_t local_expert;  // j on this rank
  int32_t row;           // row of expert_y to send, -1: dropped (expert full)
  int32_t group;         // source DP group g
  int32_t token_slot;    // t * kMaxTopK + i: token t, route slot i
};
static_assert(sizeof(CombineItem) == 16);

// Signal added to the per-token combine counter: bit i when route slot i's
// row arrived, bit 16 + i when the expert rank dropped that route (kMaxTopK
// <= 16, so the two halves never overlap).
MOELINK_HD uint64_t route_arrived_bit(int slot) { return 1ull << slot; }
MOELINK_HD uint64_t route_dropped_bit(int slot) { return 1ull << (16 + slot); }
// Route slots accounted for (arrived or dropped) in a counter value.
MOELINK_HD uint32_t routes_settled(uint64_t v) {
  return static_cast<uint32_t>((v | (v >> 16)) & 0xFFFFu);
}
static_assert(kMaxTopK <= 16);

struct ShmemLayout {
  int64_t tokens_per_replica;  // Tr = ceil(T / D): tokens one replica sends at most
  // Dispatch chunk: [ChunkHeader][int32 ids x k][token][scales], 16-byte aligned parts.
  int64_t chunk_ids_offset;
  int64_t chunk_token_offset;
  int64_t chunk_scale_offset;
  int64_t chunk_bytes;
  int64_t stage_rows;  // combine staging rows: G * T * k (routes one rank can receive)

  // Offsets inside the symmetric buffer.
  int64_t dispatch_count_offset;    // u64[W][L]: count + 1 from source s for local expert j (SET)
  int64_t dispatch_arrived_offset;  // u64[W][L]: chunks from s for j arrived (ADD 1 each)
  int64_t barrier_offset;           // u64[W]: rounds source s entered combine send (ADD 1)
  int64_t token_signal_offset;      // u64[T]: route bits of token t settled (route_*_bit)
  int64_t send_chunks_offset;       // [Tr] chunks: this rank's packed tokens
  int64_t recv_chunks_offset;       // [W][L][Tr] chunks: private region per (source, local expert)
  int64_t combine_rows_offset;      // [T][k] rows of out_dtype: route slot i of token t
  int64_t combine_stage_offset;     // [stage_rows] rows of out_dtype: expert outputs being sent
  int64_t total_bytes;

  MOELINK_HD int64_t pair(const Geometry& g, int source, int local_expert) const {
    return static_cast<int64_t>(source) * g.num_local_experts + local_expert;
  }
  MOELINK_HD int64_t dispatch_count(const Geometry& g, int source, int j) const {
    return dispatch_count_offset + 8 * pair(g, source, j);
  }
  MOELINK_HD int64_t dispatch_arrived(const Geometry& g, int source, int j) const {
    return dispatch_arrived_offset + 8 * pair(g, source, j);
  }
  MOELINK_HD int64_t barrier(int source) const { return barrier_offset + 8 * source; }
  MOELINK_HD int64_t token_signal(int64_t t) const { return token_signal_offset + 8 * t; }
  MOELINK_HD int64_t send_chunk(int64_t u) const { return send_chunks_offset + u * chunk_bytes; }
  MOELINK_HD int64_t recv_chunk(const Geometry& g, int source, int j, int64_t c) const {
    return recv_chunks_offset + (pair(g, source, j) * tokens_per_replica + c) * chunk_bytes;
  }
  MOELINK_HD int64_t combine_row(const Geometry& g, int64_t t, int slot) const {
    return combine_rows_offset + (t * g.experts_per_token + slot) * g.combine_row_bytes;
  }
  MOELINK_HD int64_t combine_stage(const Geometry& g, int64_t q) const {
    return combine_stage_offset + q * g.combine_row_bytes;
  }
};

inline ShmemLayout make_shmem_layout(const Geometry& g) {
  ShmemLayout s{};
  const int64_t W = g.world_size, L = g.num_local_experts, T = g.max_num_tokens;
  const int64_t k = g.experts_per_token;
  s.tokens_per_replica = (T + g.dp_size - 1) / g.dp_size;
  s.chunk_ids_offset = sizeof(ChunkHeader);
  s.chunk_token_offset = align_up(s.chunk_ids_offset + 4 * k, 16);
  s.chunk_scale_offset = s.chunk_token_offset + align_up(g.token_bytes, 16);
  s.chunk_bytes = s.chunk_scale_offset + align_up(g.scale_bytes, 16);
  s.stage_rows = static_cast<int64_t>(g.num_dp_groups) * T * k;
  s.dispatch_count_offset = 0;
  s.dispatch_arrived_offset = align_up(s.dispatch_count_offset + 8 * W * L, 128);
  s.barrier_offset = align_up(s.dispatch_arrived_offset + 8 * W * L, 128);
  s.token_signal_offset = align_up(s.barrier_offset + 8 * W, 128);
  s.send_chunks_offset = align_up(s.token_signal_offset + 8 * T, 4096);
  s.recv_chunks_offset = align_up(s.send_chunks_offset + s.tokens_per_replica * s.chunk_bytes, 4096);
  s.combine_rows_offset =
      align_up(s.recv_chunks_offset + W * L * s.tokens_per_replica * s.chunk_bytes, 4096);
  s.combine_stage_offset = align_up(s.combine_rows_offset + T * k * g.combine_row_bytes, 4096);
  s.total_bytes = align_up(s.combine_stage_offset + s.stage_rows * g.combine_row_bytes, 1 << 21);
  return s;
}

}  // namespace moelink::detail::shmem
