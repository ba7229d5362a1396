// Work-request builders for the RC data path (issue 3, ConnectX-7):
//  * WriteTemplate: one prebuilt RDMA_WRITE[_WITH_IMM] per (peer, remote
//    buffer) -- WR templating: the constant fields (opcode, rkey, remote
//    base) are set once when a peer group is added; each op fills only
//    address, length, offset and immediate.
//  * WriteChain: several small writes to one peer linked into one
//    ibv_post_send (one doorbell instead of n), only the last signaled.
//  * SendQueueSlots: send-queue depth accounting, because unsignaled WRs
//    hold their slot until a later signaled WR on the same QP completes.
//  * RecvChain: receive WRs, both for immediates (no sge: WRITE_WITH_IMM
//    data goes to the remote address, the receive only carries the imm) and
//    for two-sided messages (one buffer slot each). Different sizes is why
//    SEND/RECV and WRITE_IMM use separate QPs: both consume receives in order.
// Pure struct building: no libibverbs call is made here.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs {

// ibv_send_wr::imm_data and ibv_wc::imm_data are big-endian (__be32): the
// engine's immediates are host-order numbers, converted here and only here.
uint32_t imm_to_wire(uint32_t imm);
uint32_t imm_from_wire(uint32_t wire);

struct RemoteBuffer {
  uint64_t addr = 0;  // remote virtual address of byte 0
  uint32_t rkey = 0;
  uint64_t size = 0;
  bool operator==(const RemoteBuffer&) const = default;
};

// One write: len bytes from local_addr (registered with lkey) to
// remote_offset of the template's remote buffer.
struct WriteOp {
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint32_t len = 0;
  uint64_t remote_offset = 0;
  std::optional<uint32_t> imm;  // WRITE_WITH_IMM when set, plain WRITE otherwise
};

class WriteTemplate {
 public:
  // max_inline: the QP's granted max_inline_data; writes up to that many
  // bytes are copied into the WQE (IBV_SEND_INLINE), saving the NIC a DMA
  // read of the source -- which matters for the tiny writes of MoE dispatch.
  WriteTemplate(const RemoteBuffer& remote, uint32_t max_inline);
  WriteTemplate(const WriteTemplate&) = delete;  // wr_.sg_list points at sge_
  WriteTemplate& operator=(const WriteTemplate&) = delete;

  // Fills the template for one op and returns it (next = null). Throws
  // InvalidArgument when the op leaves the remote buffer. The result stays
  // valid until the next fill (ibv_post_send copies it, so post at once).
  ibv_send_wr* fill(const WriteOp& op, uint64_t wr_id, bool signaled);

  const RemoteBuffer& remote() const { return remote_; }

 private:
  RemoteBuffer remote_;
  uint32_t max_inline_;
  ibv_sge sge_{};
  ibv_send_wr wr_{};
};

// Sets the per-op fields of a WRITE WR (shared by WriteTemplate and
// WriteChain so both produce identical WRs).
void fill_write(ibv_send_wr& wr, ibv_sge& sge, const RemoteBuffer& remote, uint32_t max_inline,
                const WriteOp& op, uint64_t wr_id, bool signaled);

class WriteChain {
 public:
  // Capacity = min(max_len, caps.max_send_wr): a chain longer than the send
  // queue could never be posted. caps.max_inline_data decides inlining.
  WriteChain(const RemoteBuffer& remote, const QpCaps& caps, uint32_t max_len);
  WriteChain(const WriteChain&) = delete;  // WRs point at sges_
  WriteChain& operator=(const WriteChain&) = delete;

  size_t size() const { return n_; }
  size_t capacity() const { return wrs_.size(); }
  bool full() const { return n_ == wrs_.size(); }
  // Appends one write to the chain's remote buffer; throws InvalidArgument
  // when full or out of range.
  void add(const WriteOp& op);
  // Appends one write to its own remote buffer (the engine's writes to one
  // peer may target different registrations, each with its rkey).
  void add(const WriteOp& op, const RemoteBuffer& remote);
  // Links the chain (wrs[i].next = &wrs[i+1], last next = null), signals
  // only the last WR and returns the head, or null when empty. Every WR
  // carries wr_id: an unsignaled WR that fails still produces an error
  // completion, and it must name the same operation.
  ibv_send_wr* finish(uint64_t wr_id);
  // The same with one wr_id per WR (wr_ids.size() >= size()): the verbs
  // transport numbers every WR, so an error completion tells which failed.
  ibv_send_wr* finish(std::span<const uint64_t> wr_ids);
  void clear() { n_ = 0; }

 private:
  RemoteBuffer remote_;
  uint32_t max_inline_;
  std::vector<WriteOp> ops_;
  std::vector<RemoteBuffer> remotes_;  // per op
  std::vector<ibv_sge> sges_;
  std::vector<ibv_send_wr> wrs_;
  size_t n_ = 0;
};

// Two-sided SEND on the message QP: small messages inline.
ibv_send_wr* fill_send(ibv_send_wr& wr, ibv_sge& sge, uint64_t local_addr, uint32_t lkey,
                       uint32_t len, uint32_t max_inline, uint64_t wr_id);

// Free send-queue slots of one QP. A chain of n WRs takes n slots, returned
// when its (last, signaled) WR completes: the NIC frees unsignaled WQEs only
// then. Post only what try_take allowed.
class SendQueueSlots {
 public:
  explicit SendQueueSlots(uint32_t depth) : depth_(depth) {}
  bool try_take(uint32_t n);
  void give_back(uint32_t n);  // throws InvalidArgument on underflow
  uint32_t free() const { return depth_ - used_; }

 private:
  uint32_t depth_;
  uint32_t used_ = 0;
};

class RecvChain {
 public:
  explicit RecvChain(uint32_t capacity);
  RecvChain(const RecvChain&) = delete;
  RecvChain& operator=(const RecvChain&) = delete;

  // n receives without sge for WRITE_WITH_IMM, wr_id = first_id + i.
  ibv_recv_wr* imm(uint64_t first_id, uint32_t n);
  // n receives into slots of `slot_bytes` of a buffer of `total_slots`
  // slots starting at base: wr i takes slot (first_slot + i) % total_slots
  // and has wr_id = that slot (so the completion tells which slot to read).
  ibv_recv_wr* slots(uint64_t base, uint32_t lkey, uint32_t slot_bytes, uint32_t total_slots,
                     uint32_t first_slot, uint32_t n);

 private:
  ibv_recv_wr* link(uint32_t n);
  std::vector<ibv_sge> sges_;
  std::vector<ibv_recv_wr> wrs_;
};

}  // namespace moelink::fabric::verbs
