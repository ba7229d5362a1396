// The inter-node all-to-all protocol's buffers, immediates and offset math
// (docs/internode.md walks through it step by step). Shared by the proxy,
// the CPU loops and the GPU kernels, so every side computes the same offsets.
//
// Per epoch (one dispatch + one combine), sender s and receiver r:
//  1. s counts its routes per destination rank (C[s][*]) and packs, for each
//     destination, one contiguous block: [RouteHeader][slot x C[s][r]].
//  2. The proxy writes the header and the first P = max_private_tokens slots
//     of each block into r's private area for s (imm kRoute|s): the routing
//     information travels with the first tokens.
//  3. Once every peer's header arrived, every rank knows the whole matrix C.
//     The rest of s's block (C[s][r] - P slots) goes in one write to r's
//     shared area at offset O[s][r] = sum_{s' < s} max(0, C[s'][r] - P)
//     (imm kData|s, only when there is a rest).
//  4. r unpacks slot j of sender s, in receive order i = sum_{s' < s}
//     C[s'][r] + j.
//  5. Combine: r writes one output row per received slot, in receive order.
//     The rows of group g's senders are contiguous; they go in one write to
//     every replica of g, at rows base(g, r) = sum_{r' < r} N[g][r'] of the
//     replica's combine area (N[g][r'] = sum_{s in g} C[s][r']), imm
//     kCombine|r; a peer without rows gets a zero-byte write with the same
//     imm. So every rank's combine waits for all peers, and a sender that
//     got r's notification knows r has unpacked: its dispatch areas are free
//     for the next epoch (no other barrier).
//  6. The replica finds token t's row from rank r' as base(g, r') +
//     sum_{s in g, s < sender(t)} C[s][r'] + j(t, r'), where j is t's
//     position among sender(t)'s tokens for r', and sums the rows.
// Immediates carry the sender's rank so a missing peer can be named.
//
// Peers of the same node (Layout::node_size consecutive ranks; a rank is
// always in its own node) exchange the bytes directly instead: the sender's
// kernels (CPU loops) store its slots for a node peer r into r's local area
// (device memory mapped over NVLink; shared memory on the CPU) at slot
// local_slot_offset(s, j), and its combine rows into every replica's local
// combine area at the same row the proxy would have written. The control
// stays with the proxies: headers (no tokens) and the combine notification
// still travel through the engine, and they are posted only after the
// direct stores were fenced, so the notification that already orders the
// remote bytes also orders the local ones (and keeps the barrier of step 5).
// Node peers take no room in the shared area. A combine row goes to each
// replica of its group by the replica's own route: directly to those in the
// node, through the engine to the others.
#pragma once

#include <cstdint>

#include "core/layout.h"

namespace moelink::detail::internode {

// What the first bytes of every dispatch block say: the sender's epoch, its
// m and its count for every destination rank (one row of C).
struct RouteHeader {
  uint32_t epoch;
  uint32_t m;
  // uint32_t counts[world_size] follow.
};

// kAbort|r: the sender gave up because rank r is gone (see Proxy::fail).
enum class ImmKind : uint32_t { kRoute = 1, kData = 2, kCombine = 3, kAbort = 4 };
constexpr int kImmRankBits = 24;
constexpr int kMaxWorldSize = 1 << kImmRankBits;

MOELINK_HD uint32_t make_imm(ImmKind kind, int rank) {
  return (static_cast<uint32_t>(kind) << kImmRankBits) | static_cast<uint32_t>(rank);
}

// Byte layout of one rank's two registered buffers and its local area.
//  recv: [private area: W x (header + P slots)][shared area: G*T slots]
//        [combine area: T * min(k, W) rows]
//  send: [dispatch blocks: W headers + T * min(k, W) slots]
//        [combine rows: G*T rows]
//  local (written by node peers, own rank included):
//        [node_size x T slots: one run per node sender][T * min(k, W) rows]
struct Layout {
  int world_size;
  int node_size;           // ranks per node, consecutive; 1: every peer remote
  int64_t private_tokens;  // P
  int64_t header_bytes;    // RouteHeader + W counts, 16-byte aligned
  int64_t slot_bytes;      // Geometry::slot_bytes
  int64_t row_bytes;       // Geometry::combine_row_bytes
  int64_t private_stride;  // header + P slots
  int64_t shared_offset;   // recv
  int64_t shared_slots;    // G * T
  int64_t combine_offset;  // recv
  int64_t combine_rows;    // T * min(k, W)
  int64_t recv_bytes;
  int64_t send_slots;           // T * min(k, W)
  int64_t send_combine_offset;  // send
  int64_t send_combine_rows;    // G * T
  int64_t send_bytes;
  int64_t local_slots;           // T: slots per node sender in the local area
  int64_t local_combine_offset;  // local
  int64_t local_bytes;

  MOELINK_HD bool is_local(int a, int b) const { return a / node_size == b / node_size; }
  MOELINK_HD int local_index(int r) const { return r % node_size; }
  // Slot j of node sender `sender` in a receiver's local area.
  MOELINK_HD int64_t local_slot_offset(int sender, int64_t j) const {
    return (local_index(sender) * local_slots + j) * slot_bytes;
  }
  MOELINK_HD int64_t local_row_offset(int64_t row) const {
    return local_combine_offset + row * row_bytes;
  }
  MOELINK_HD int64_t private_offset(int sender) const { return sender * private_stride; }
  // Where slot j of `sender` lies in this rank's recv buffer, given the
  // sender's shared-area offset (in slots).
  MOELINK_HD int64_t recv_slot_offset(int sender, int64_t j, int64_t shared_base) const {
    return j < private_tokens ? private_offset(sender) + header_bytes + j * slot_bytes
                              : shared_offset + (shared_base + j - private_tokens) * slot_bytes;
  }
};

// What the proxy tells the unpacking side after a step, as int64 words in
// memory both can read (pinned, GPU-mapped host memory for the GPU backend):
//   [0] epoch whose dispatch step succeeded (anything else: do not unpack)
//   [1] epoch whose combine step succeeded
//   [2] slots this rank received
//   recv_base[W + 1]  first receive index of each sender (+ the total)
//   shared_base[W]    each sender's offset in this rank's shared area, slots
//   row_base[dp][W]   combine row of the first token replica q sent rank r
//   row_count[dp][W]  tokens replica q of this group sent rank r
//   row_shift[G]      combine sends: the row of receive index i (a slot of
//                     group g's senders) in g's replicas is i + row_shift[g]
// Token t of this group, sent by replica q = t % dp at position j among q's
// tokens for rank r, finds r's combine row at row_base[q][r] + j
// (protocol step 6), valid when j < row_count[q][r].
struct PlanView {
  int world_size, dp_size;
  MOELINK_HD int num_groups() const { return world_size / dp_size; }
  MOELINK_HD int64_t words() const {
    return 3 + (world_size + 1) + world_size + 2 * dp_size * world_size + num_groups();
  }
  MOELINK_HD int64_t recv_base(int s) const { return 3 + s; }
  MOELINK_HD int64_t shared_base(int s) const { return 3 + (world_size + 1) + s; }
  MOELINK_HD int64_t row_base(int q, int r) const {
    return 3 + (world_size + 1) + world_size + q * world_size + r;
  }
  MOELINK_HD int64_t row_count(int q, int r) const { return row_base(q, r) + dp_size * world_size; }
  MOELINK_HD int64_t row_shift(int g) const {
    return 3 + (world_size + 1) + world_size + 2 * dp_size * world_size + g;
  }
};
constexpr int kPlanDispatchEpoch = 0, kPlanCombineEpoch = 1, kPlanReceived = 2;

// Offsets of the dispatch blocks in the send buffer, given the sender's
// counts: blocks follow each other in rank order. out[r] for r < W.
MOELINK_HD void block_offsets(const Layout& l, const uint32_t* counts, int64_t* out) {
  int64_t off = 0;
  for (int r = 0; r < l.world_size; ++r) {
    out[r] = off;
    off += l.header_bytes + counts[r] * l.slot_bytes;
  }
}

// `node_size` must divide world_size (resolve_node_size).
inline Layout make_layout(const Geometry& g, int64_t private_tokens, int node_size) {
  Layout l{};
  l.world_size = g.world_size;
  l.node_size = node_size;
  l.private_tokens = private_tokens;
  l.header_bytes = align_up(static_cast<int64_t>(sizeof(RouteHeader)) + 4 * g.world_size, 16);
  l.slot_bytes = g.slot_bytes;
  l.row_bytes = align_up(g.combine_row_bytes, 16);
  const int64_t fan_out = g.experts_per_token < g.world_size ? g.experts_per_token : g.world_size;
  l.private_stride = l.header_bytes + private_tokens * l.slot_bytes;
  l.shared_offset = align_up(g.world_size * l.private_stride, 4096);
  l.shared_slots = static_cast<int64_t>(g.num_dp_groups) * g.max_num_tokens;
  l.combine_offset = align_up(l.shared_offset + l.shared_slots * l.slot_bytes, 4096);
  l.combine_rows = g.max_num_tokens * fan_out;
  l.recv_bytes = align_up(l.combine_offset + l.combine_rows * l.row_bytes, 4096);
  l.send_slots = g.max_num_tokens * fan_out;
  l.send_combine_offset =
      align_up(g.world_size * l.header_bytes + l.send_slots * l.slot_bytes, 4096);
  l.send_combine_rows = l.shared_slots;
  l.send_bytes = align_up(l.send_combine_offset + l.send_combine_rows * l.row_bytes, 4096);
  l.local_slots = g.max_num_tokens;
  l.local_combine_offset = align_up(node_size * l.local_slots * l.slot_bytes, 4096);
  l.local_bytes = align_up(l.local_combine_offset + l.combine_rows * l.row_bytes, 4096);
  return l;
}

}  // namespace moelink::detail::internode
