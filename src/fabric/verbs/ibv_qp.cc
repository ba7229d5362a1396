// COMPILED ONLY -- never run (see ibv_device.h).
#include "fabric/verbs/ibv_qp.h"

#include <cstring>
#include <string>

#include "fabric/verbs/ibv_device.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

template <typename Wr>
int index_of(Wr* head, Wr* bad) {
  int i = 0;
  for (Wr* w = head; w && w != bad; w = w->next) ++i;
  return i;
}

}  // namespace

IbvQp::IbvQp(const IbvDevice& device, ibv_qp* qp, QpType type, const QpCaps& granted,
             uint32_t qkey)
    : device_(device), qp_(qp), type_(type), caps_(granted), qkey_(qkey) {}

IbvQp::~IbvQp() { ibv_destroy_qp(qp_); }

void IbvQp::modify(ibv_qp_attr& attr, int mask, QpState next, const char* step) {
  if (int rc = ibv_modify_qp(qp_, &attr, mask)) {
    state_ = QpState::kError;
    throw FabricError(std::string("verbs ibv_modify_qp(") + step + ") of QP " +
                      std::to_string(qp_->qp_num) + ": " + std::strerror(rc));
  }
  state_ = next;
}

void IbvQp::to_init() {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = device_.options().port;
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (type_ == QpType::kRc) {
    // Peers write into our buffers (WRITE_WITH_IMM); nobody reads or does
    // atomics, so only remote write is granted.
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    mask |= IBV_QP_ACCESS_FLAGS;
  } else {
    a.qkey = qkey_;
    mask |= IBV_QP_QKEY;
  }
  modify(a, mask, QpState::kInit, "INIT");
}

void IbvQp::to_rtr(const RcRemote* remote) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  int mask = IBV_QP_STATE;
  if (type_ == QpType::kRc) {
    if (!remote) throw FabricError("verbs RC QP to RTR without a remote QP");
    a.path_mtu = device_.active_mtu();
    a.dest_qp_num = remote->qpn;
    a.rq_psn = remote->psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = device_.options().min_rnr_timer;
    a.ah_attr = device_.ah_attr(remote->addr);
    mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  modify(a, mask, QpState::kRtr, "RTR");
}

void IbvQp::to_rts(uint32_t sq_psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = sq_psn & 0xffffff;
  int mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  if (type_ == QpType::kRc) {
    a.timeout = device_.options().timeout;
    a.retry_cnt = device_.options().retry_cnt;
    a.rnr_retry = device_.options().rnr_retry;
    a.max_rd_atomic = 1;
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  }
  modify(a, mask, QpState::kRts, "RTS");
}

void IbvQp::post_send(ibv_send_wr* wr) {
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_, wr, &bad)) {
    throw FabricError("verbs ibv_post_send on QP " + std::to_string(qp_->qp_num) + ": WR " +
                      std::to_string(index_of(wr, bad)) + " rejected: " + std::strerror(rc));
  }
}

void IbvQp::post_recv(ibv_recv_wr* wr) {
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(qp_, wr, &bad)) {
    throw FabricError("verbs ibv_post_recv on QP " + std::to_string(qp_->qp_num) + ": WR " +
                      std::to_string(index_of(wr, bad)) + " rejected: " + std::strerror(rc));
  }
}

}  // namespace moelink::fabric::verbs
