#include "fabric/verbs/wr_builder.h"

#include <arpa/inet.h>

#include <algorithm>

#include <string>

#include "moelink/errors.h"

namespace moelink::fabric::verbs {

uint32_t imm_to_wire(uint32_t imm) { return htonl(imm); }
uint32_t imm_from_wire(uint32_t wire) { return ntohl(wire); }

void fill_write(ibv_send_wr& wr, ibv_sge& sge, const RemoteBuffer& remote, uint32_t max_inline,
                const WriteOp& op, uint64_t wr_id, bool signaled) {
  // Checked here, on the posting thread: the NIC would fail the whole QP
  // (remote access error -> QP in error state) instead of one op.
  if (op.remote_offset > remote.size || op.len > remote.size - op.remote_offset) {
    throw InvalidArgument("verbs write: " + std::to_string(op.len) + " bytes at offset " +
                          std::to_string(op.remote_offset) + " exceed the remote buffer of " +
                          std::to_string(remote.size) + " bytes");
  }
  wr = ibv_send_wr{};
  wr.wr_id = wr_id;
  wr.opcode = op.imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (op.imm) wr.imm_data = imm_to_wire(*op.imm);
  wr.wr.rdma.remote_addr = remote.addr + op.remote_offset;
  wr.wr.rdma.rkey = remote.rkey;
  if (op.len == 0) {
    // Zero-byte WRITE_WITH_IMM (barrier): no sge at all.
    wr.sg_list = nullptr;
    wr.num_sge = 0;
  } else {
    sge.addr = op.local_addr;
    sge.length = op.len;
    sge.lkey = op.lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (op.len <= max_inline) wr.send_flags |= IBV_SEND_INLINE;
  }
  if (signaled) wr.send_flags |= IBV_SEND_SIGNALED;
}

WriteTemplate::WriteTemplate(const RemoteBuffer& remote, uint32_t max_inline)
    : remote_(remote), max_inline_(max_inline) {}

ibv_send_wr* WriteTemplate::fill(const WriteOp& op, uint64_t wr_id, bool signaled) {
  fill_write(wr_, sge_, remote_, max_inline_, op, wr_id, signaled);
  return &wr_;
}

WriteChain::WriteChain(const RemoteBuffer& remote, const QpCaps& caps, uint32_t max_len)
    : remote_(remote), max_inline_(caps.max_inline_data) {
  const uint32_t cap = std::min(max_len, caps.max_send_wr);
  if (cap == 0) throw InvalidArgument("verbs write chain: capacity 0 (max_len or max_send_wr)");
  ops_.resize(cap);
  remotes_.resize(cap);
  sges_.resize(cap);
  wrs_.resize(cap);
}

void WriteChain::add(const WriteOp& op) { add(op, remote_); }

void WriteChain::add(const WriteOp& op, const RemoteBuffer& remote) {
  if (full()) {
    throw InvalidArgument("verbs write chain: full at " + std::to_string(wrs_.size()) + " WRs");
  }
  // Validate now (fill_write throws) so a bad op is rejected before the
  // chain is posted; the WR itself is (re)built in finish().
  ibv_send_wr probe{};
  ibv_sge probe_sge{};
  fill_write(probe, probe_sge, remote, max_inline_, op, 0, false);
  remotes_[n_] = remote;
  ops_[n_++] = op;
}

ibv_send_wr* WriteChain::finish(uint64_t wr_id) {
  if (n_ == 0) return nullptr;
  for (size_t i = 0; i < n_; ++i) {
    fill_write(wrs_[i], sges_[i], remotes_[i], max_inline_, ops_[i], wr_id, i + 1 == n_);
    wrs_[i].next = i + 1 == n_ ? nullptr : &wrs_[i + 1];
  }
  return &wrs_[0];
}

ibv_send_wr* WriteChain::finish(std::span<const uint64_t> wr_ids) {
  if (n_ == 0) return nullptr;
  if (wr_ids.size() < n_) {
    throw InvalidArgument("verbs write chain: " + std::to_string(wr_ids.size()) + " wr_ids for " +
                          std::to_string(n_) + " WRs");
  }
  for (size_t i = 0; i < n_; ++i) {
    fill_write(wrs_[i], sges_[i], remotes_[i], max_inline_, ops_[i], wr_ids[i], i + 1 == n_);
    wrs_[i].next = i + 1 == n_ ? nullptr : &wrs_[i + 1];
  }
  return &wrs_[0];
}

ibv_send_wr* fill_send(ibv_send_wr& wr, ibv_sge& sge, uint64_t local_addr, uint32_t lkey,
                       uint32_t len, uint32_t max_inline, uint64_t wr_id) {
  wr = ibv_send_wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;  // the sender must learn when its buffer is free
  if (len > 0) {
    sge = ibv_sge{local_addr, len, lkey};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (len <= max_inline) wr.send_flags |= IBV_SEND_INLINE;
  }
  return &wr;
}

bool SendQueueSlots::try_take(uint32_t n) {
  if (n > depth_ - used_) return false;
  used_ += n;
  return true;
}

void SendQueueSlots::give_back(uint32_t n) {
  if (n > used_) {
    throw InvalidArgument("verbs send queue: giving back " + std::to_string(n) + " slots, " +
                          std::to_string(used_) + " in use");
  }
  used_ -= n;
}

RecvChain::RecvChain(uint32_t capacity) : sges_(capacity), wrs_(capacity) {
  if (capacity == 0) throw InvalidArgument("verbs receive chain: capacity 0");
}

ibv_recv_wr* RecvChain::link(uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) wrs_[i].next = i + 1 == n ? nullptr : &wrs_[i + 1];
  return &wrs_[0];
}

ibv_recv_wr* RecvChain::imm(uint64_t first_id, uint32_t n) {
  if (n == 0 || n > wrs_.size()) {
    throw InvalidArgument("verbs receive chain: " + std::to_string(n) + " receives, capacity " +
                          std::to_string(wrs_.size()));
  }
  for (uint32_t i = 0; i < n; ++i) {
    wrs_[i] = ibv_recv_wr{};
    wrs_[i].wr_id = first_id + i;
    wrs_[i].sg_list = nullptr;
    wrs_[i].num_sge = 0;
  }
  return link(n);
}

ibv_recv_wr* RecvChain::slots(uint64_t base, uint32_t lkey, uint32_t slot_bytes,
                              uint32_t total_slots, uint32_t first_slot, uint32_t n) {
  if (n == 0 || n > wrs_.size() || n > total_slots || first_slot >= total_slots ||
      slot_bytes == 0) {
    throw InvalidArgument("verbs receive chain: " + std::to_string(n) + " receives from slot " +
                          std::to_string(first_slot) + " of " + std::to_string(total_slots) +
                          " (slot bytes " + std::to_string(slot_bytes) + ", capacity " +
                          std::to_string(wrs_.size()) + ")");
  }
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t slot = (first_slot + i) % total_slots;
    sges_[i] = ibv_sge{base + uint64_t{slot} * slot_bytes, slot_bytes, lkey};
    wrs_[i] = ibv_recv_wr{};
    wrs_[i].wr_id = slot;
    wrs_[i].sg_list = &sges_[i];
    wrs_[i].num_sge = 1;
  }
  return link(n);
}

}  // namespace moelink::fabric::verbs
