// The real Qp over libibverbs: ibv_modify_qp state steps for RC and UD and
// ibv_post_send/recv. COMPILED ONLY, never run (see ibv_device.h).
#pragma once

#include <infiniband/verbs.h>

#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs {

class IbvDevice;

class IbvQp final : public Qp {
 public:
  IbvQp(const IbvDevice& device, ibv_qp* qp, QpType type, const QpCaps& granted, uint32_t qkey);
  ~IbvQp() override;

  QpType type() const override { return type_; }
  uint32_t qpn() const override { return qp_->qp_num; }
  const QpCaps& caps() const override { return caps_; }
  QpState state() const override { return state_; }
  void to_init() override;
  void to_rtr(const RcRemote* remote) override;
  void to_rts(uint32_t sq_psn) override;
  void post_send(ibv_send_wr* wr) override;
  void post_recv(ibv_recv_wr* wr) override;

 private:
  void modify(ibv_qp_attr& attr, int mask, QpState next, const char* step);

  const IbvDevice& device_;
  ibv_qp* qp_;
  QpType type_;
  QpCaps caps_;
  uint32_t qkey_;
  QpState state_ = QpState::kReset;
};

}  // namespace moelink::fabric::verbs
