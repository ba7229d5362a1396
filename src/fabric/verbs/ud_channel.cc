#include "fabric/verbs/ud_channel.h"

#include <cstring>
#include <string>

#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {

UdChannel::UdChannel(Device& device, uint32_t recv_slots, uint32_t send_slots)
    : device_(device),
      recv_slots_(recv_slots),
      send_slots_(send_slots),
      buffer_(size_t{recv_slots + send_slots} * kSlotBytes) {
  if (recv_slots == 0 || send_slots == 0) {
    throw InvalidArgument("verbs UD channel: needs at least one receive and one send slot");
  }
  mr_ = device_.register_memory(buffer_.data(), buffer_.size());
  cq_ = device_.create_cq(static_cast<int>(recv_slots + send_slots));
  QpInit init;
  init.type = QpType::kUd;
  init.send_cq = cq_.get();
  init.recv_cq = cq_.get();
  init.caps = QpCaps{send_slots, recv_slots, 1, 1, 0};
  init.qkey = kQkey;
  qp_ = device_.create_qp(init);
  qp_->to_init();
  // Receives may be posted from INIT on; post them before RTR so nothing
  // that arrives early is dropped for lack of a receive.
  for (uint32_t s = 0; s < recv_slots_; ++s) post_recv(s);
  qp_->to_rtr(nullptr);
  qp_->to_rts(0);
  for (uint32_t s = 0; s < send_slots_; ++s) free_send_.push_back(recv_slots_ + s);
}

void UdChannel::post_recv(uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(slot_ptr(slot)), kSlotBytes, mr_->lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  qp_->post_recv(&wr);
}

AddressHandle& UdChannel::ah(const PortAddress& dest) {
  for (auto& [addr, h] : ahs_) {
    if (addr == dest) return *h;
  }
  ahs_.emplace_back(dest, device_.create_ah(dest));
  return *ahs_.back().second;
}

bool UdChannel::send(const UdContact& to, std::span<const uint8_t> bytes) {
  if (bytes.size() > kMaxPayload) {
    throw InvalidArgument("verbs UD channel: datagram of " + std::to_string(bytes.size()) +
                          " bytes, at most " + std::to_string(kMaxPayload));
  }
  if (free_send_.empty()) {
    ++dropped_sends_;
    return false;
  }
  const uint32_t slot = free_send_.back();
  free_send_.pop_back();
  std::memcpy(slot_ptr(slot), bytes.data(), bytes.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(slot_ptr(slot)), static_cast<uint32_t>(bytes.size()),
              mr_->lkey()};
  ibv_send_wr wr{};
  wr.wr_id = kSendTag | slot;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;  // every send: its completion frees the slot
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.ud.ah = ah(to.addr).get();
  wr.wr.ud.remote_qpn = to.qpn;
  wr.wr.ud.remote_qkey = kQkey;
  try {
    qp_->post_send(&wr);
  } catch (...) {
    free_send_.push_back(slot);
    throw;
  }
  return true;
}

int UdChannel::poll(const std::function<void(std::span<const uint8_t>)>& on_datagram) {
  ibv_wc wcs[16];
  int total = 0;
  for (;;) {
    const int n = cq_->poll(wcs);
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      if (wc.wr_id & kSendTag) {
        // A failed UD send is a lost datagram, which the protocol tolerates.
        if (wc.status != IBV_WC_SUCCESS) ++failed_sends_;
        free_send_.push_back(static_cast<uint32_t>(wc.wr_id & ~kSendTag));
        continue;
      }
      const auto slot = static_cast<uint32_t>(wc.wr_id);
      if (wc.status != IBV_WC_SUCCESS) {
        throw FabricError(std::string("verbs UD channel: receive completion failed: ") +
                          ibv_wc_status_str(wc.status));
      }
      if (slot >= recv_slots_) continue;  // not one of our receives: never reposted
      if (wc.byte_len >= kGrhBytes) {
        on_datagram({slot_ptr(slot) + kGrhBytes, wc.byte_len - kGrhBytes});
      }
      post_recv(slot);
    }
    total += n;
    if (n < static_cast<int>(std::size(wcs))) return total;
  }
}

}  // namespace moelink::fabric::verbs
