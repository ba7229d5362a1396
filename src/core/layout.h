// Layout math shared by every backend and by host and device code: which
// rank holds an expert, which replica sends a token, where each staging slot,
// combine row and flag lives in a rank's peer-visible buffer, and what the
// error record looks like. One definition, so the CPU backend, the NVLink
// kernels and the host agree byte for byte.
#pragma once

#include <cstdint>

#include "moelink/types.h"

#if defined(__CUDACC__)
#define MOELINK_HD __host__ __device__ __forceinline__
#else
#define MOELINK_HD inline
#endif

namespace moelink::detail {

MOELINK_HD constexpr int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

constexpr int kMaxTopK = 16;

// Header of a dispatch staging slot. Followed by `num_routes` RouteEntry
// records (padded to 16 bytes), then the token row, then its scales.
// `epoch` marks the slot as written by the dispatch of that epoch: slots are
// never cleared, a stale epoch means "no token for this rank".
struct SlotHeader {
  uint32_t epoch;
  uint32_t num_routes;
  uint32_t token;  // token index t in the source DP group
  uint32_t reserved;
};
struct RouteEntry {
  int32_t local_expert;  // j in [0, L) on the receiving rank
  float weight;
};
static_assert(sizeof(SlotHeader) == 16);

// Set in SlotHeader::num_routes when the header was stored last, with
// release semantics, by the slot's only writer: the slot is complete before
// its sender's flag says so (lets a receiver start early).
constexpr uint32_t kSlotComplete = 0x80000000u;
// The first 8 bytes of a SlotHeader (epoch, num_routes) as one word.
MOELINK_HD uint64_t slot_header_word(uint32_t epoch, uint32_t num_routes) {
  return static_cast<uint64_t>(epoch) | (static_cast<uint64_t>(num_routes) << 32);
}
MOELINK_HD uint32_t slot_header_epoch(uint64_t w) { return static_cast<uint32_t>(w); }
MOELINK_HD uint32_t slot_header_routes(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
static_assert(sizeof(RouteEntry) == 8);

// Everything a kernel or CPU loop needs to address buffers. Plain data:
// passed by value to kernels.
struct Geometry {
  int rank;
  int world_size;
  int dp_size;
  int num_dp_groups;
  int num_experts;
  int num_local_experts;
  int experts_per_token;
  int hidden_dim_scale;
  int64_t max_num_tokens;
  int64_t hidden_dim;
  int64_t expert_capacity;  // rows per local expert: max_num_tokens * num_dp_groups
  int64_t token_bytes;      // hidden_dim * sizeof(in_dtype)
  int64_t scale_bytes;      // hidden_dim_scale * 4
  int64_t combine_row_bytes;  // hidden_dim * sizeof(out_dtype)

  // Staging slot: [SlotHeader][RouteEntry x k][token][scales], 16-byte aligned parts.
  int64_t slot_routes_offset;  // == sizeof(SlotHeader)
  int64_t slot_token_offset;
  int64_t slot_scale_offset;
  int64_t slot_bytes;

  // Offsets inside one rank's peer-visible buffer.
  // Flags are cumulative counters: sender s adds 1 per finished sending
  // unit (a thread block on the GPU, the whole call on the CPU) to slot s,
  // so the round of epoch e is complete at epoch * units
  // (send_complete_count). No flag is ever reset.
  int64_t dispatch_flags_offset;  // uint64[world_size]: dispatch send units done
  int64_t dispatch_m_offset;      // uint64[world_size]: (epoch << 32) | m of sender
  int64_t combine_flags_offset;   // uint64[world_size]: combine send units done
  int64_t staging_offset;         // slots [num_dp_groups][max_num_tokens]
  int64_t combine_offset;         // rows  [world_size][max_num_tokens] of out_dtype
  int64_t total_bytes;

  MOELINK_HD int dp_group_of(int r) const { return r / dp_size; }
  MOELINK_HD int dp_group() const { return rank / dp_size; }
  // The replica of a DP group that sends token t: sends are spread evenly.
  MOELINK_HD int sender_replica(int64_t t) const { return static_cast<int>(t % dp_size); }
  MOELINK_HD bool sends_token(int64_t t) const { return sender_replica(t) == rank % dp_size; }
  MOELINK_HD int rank_of_expert(int64_t e) const { return static_cast<int>(e / num_local_experts); }
  MOELINK_HD int64_t staging_slot_offset(int g, int64_t t) const {
    return staging_offset + (static_cast<int64_t>(g) * max_num_tokens + t) * slot_bytes;
  }
  MOELINK_HD int64_t combine_row_offset(int src_rank, int64_t t) const {
    return combine_offset + (static_cast<int64_t>(src_rank) * max_num_tokens + t) * combine_row_bytes;
  }
};

// `in_bytes`, `out_bytes`: element sizes of in_dtype and out_dtype.
inline Geometry make_geometry(int rank, int world_size, int dp_size, int num_experts, int top_k,
                              int64_t max_num_tokens, int64_t hidden_dim, int hidden_dim_scale,
                              int in_bytes, int out_bytes) {
  Geometry g{};
  g.rank = rank;
  g.world_size = world_size;
  g.dp_size = dp_size;
  g.num_dp_groups = world_size / dp_size;
  g.num_experts = num_experts;
  g.num_local_experts = num_experts / world_size;
  g.experts_per_token = top_k;
  g.hidden_dim_scale = hidden_dim_scale;
  g.max_num_tokens = max_num_tokens;
  g.hidden_dim = hidden_dim;
  g.expert_capacity = max_num_tokens * g.num_dp_groups;
  g.token_bytes = hidden_dim * in_bytes;
  g.scale_bytes = static_cast<int64_t>(hidden_dim_scale) * 4;
  g.combine_row_bytes = hidden_dim * out_bytes;
  g.slot_routes_offset = sizeof(SlotHeader);
  g.slot_token_offset = align_up(g.slot_routes_offset + top_k * sizeof(RouteEntry), 16);
  g.slot_scale_offset = g.slot_token_offset + align_up(g.token_bytes, 16);
  g.slot_bytes = g.slot_scale_offset + align_up(g.scale_bytes, 16);
  g.dispatch_flags_offset = 0;
  g.dispatch_m_offset = align_up(8 * world_size, 128);
  g.combine_flags_offset = align_up(g.dispatch_m_offset + 8 * world_size, 128);
  g.staging_offset = align_up(g.combine_flags_offset + 8 * world_size, 4096);
  g.combine_offset =
      align_up(g.staging_offset + g.num_dp_groups * max_num_tokens * g.slot_bytes, 4096);
  g.total_bytes = align_up(g.combine_offset + world_size * max_num_tokens * g.combine_row_bytes,
                           1 << 21);
  return g;
}

// Flag value at which every one of a sender's `units` has finished `epoch`.
MOELINK_HD uint64_t send_complete_count(uint32_t epoch, int units) {
  return static_cast<uint64_t>(epoch) * static_cast<uint64_t>(units);
}

MOELINK_HD uint64_t dispatch_flag(uint32_t epoch, uint32_t m) {
  return (static_cast<uint64_t>(epoch) << 32) | m;
}
MOELINK_HD uint32_t dispatch_flag_epoch(uint64_t f) { return static_cast<uint32_t>(f >> 32); }
MOELINK_HD uint32_t dispatch_flag_m(uint64_t f) { return static_cast<uint32_t>(f); }

// Reads indices[t][i] (element offset `off`) of any supported index dtype.
// Returns -1 for "no route" (-1, or 0xffffffff for uint32), else the raw id.
MOELINK_HD int64_t load_expert_id(const void* base, DType dtype, int64_t off) {
  switch (dtype) {
    case DType::kInt32: return static_cast<const int32_t*>(base)[off];
    case DType::kUInt32: {
      uint32_t v = static_cast<const uint32_t*>(base)[off];
      return v == 0xffffffffu ? -1 : static_cast<int64_t>(v);
    }
    default: return static_cast<const int64_t*>(base)[off];
  }
}

enum class RouteKind : int { kNone, kValid, kInvalid };
MOELINK_HD RouteKind classify_route(int64_t e, int num_experts) {
  if (e == -1) return RouteKind::kNone;
  if (e >= 0 && e < num_experts) return RouteKind::kValid;
  return RouteKind::kInvalid;
}

// Error record written by the first failing check on the device (or CPU
// backend) and read by AllToAll::check().
enum class ErrorCode : int32_t {
  kOk = 0,
  kBadExpertId = 1,      // value = expert id, extra = flat route index t * k + i
  kBoundMTooLarge = 2,   // value = m
  kExpertOverflow = 3,   // value = local expert, extra = capacity
  kTimeout = 4,          // peer = the rank waited for
  kPeerLost = 5,         // a transfer failed or a peer broke the protocol; peer or -1
};
enum class Phase : int32_t { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };

struct ErrorRecord {
  int32_t code;  // ErrorCode
  int32_t phase;  // Phase
  int32_t peer;
  int32_t reserved;
  int64_t value;
  int64_t extra;
};

const char* phase_name(Phase p);

// Clamps m to [0, max_num_tokens]; sets *bad when it had to.
MOELINK_HD int64_t clamp_m(int32_t m, int64_t max_num_tokens, bool* bad) {
  if (m < 0) {
    *bad = true;
    return 0;
  }
  if (m > max_num_tokens) {
    *bad = true;
    return max_num_tokens;
  }
  *bad = false;
  return m;
}

}  // namespace moelink::detail
