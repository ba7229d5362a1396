#include "raw_fabric.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstring>
#include <stdexcept>
#include <thread>

namespace moelink_fabric_bench {

namespace {

void check(int rc, const std::string& what) {
  if (rc < 0)
    throw std::runtime_error("raw libfabric: " + what + ": " + fi_strerror(-rc) + " (" +
                             std::to_string(rc) + ")");
}

std::string prov_hint(const std::string& p) { return p == "tcp" ? "tcp;ofi_rxm" : p; }

// The engine's fi_getinfo hints (src/fabric/fabric_domain.cc), restated.
fi_info* getinfo(const std::string& provider, bool hmem) {
  fi_info* hints = fi_allocinfo();
  hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  if (hmem) hints->caps |= FI_HMEM;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                FI_MR_PROV_KEY | FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->av_type = FI_AV_TABLE;
  hints->tx_attr->msg_order = FI_ORDER_NONE;
  hints->rx_attr->msg_order = FI_ORDER_NONE;
  hints->fabric_attr->prov_name = strdup(prov_hint(provider).c_str());
  fi_info* info = nullptr;
  const int rc = fi_getinfo(fi_version(), nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  return rc == 0 ? info : nullptr;
}

}  // namespace

RawFabric::RawFabric(const std::string& provider, bool yield_when_idle, double timeout_s)
    : yield_(yield_when_idle), timeout_s_(timeout_s) {
  const std::string want = prov_hint(provider);
  for (bool hmem : {true, false}) {
    list_ = getinfo(provider, hmem);
    for (fi_info* i = list_; i && !info_; i = i->next)
      if (i->domain_attr->cq_data_size >= 4 && want == i->fabric_attr->prov_name) info_ = i;
    if (info_) {
      hmem_ = hmem;
      break;
    }
    if (list_) fi_freeinfo(list_);
    list_ = nullptr;
  }
  if (!info_) throw std::runtime_error("raw libfabric: provider '" + provider + "' unavailable");
  provider_name_ = info_->fabric_attr->prov_name;
  const uint64_t mr_mode = info_->domain_attr->mr_mode;
  virt_addr_ = mr_mode & FI_MR_VIRT_ADDR;
  prov_key_ = mr_mode & FI_MR_PROV_KEY;
  mr_endpoint_ = mr_mode & FI_MR_ENDPOINT;
  rx_cq_data_ = info_->mode & FI_RX_CQ_DATA;
  check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
  check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open");
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_NONE;
  cq_attr.size = 4096;
  check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open");
  check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint");
  check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
  check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  check(fi_enable(ep_), "fi_enable");
  char buf[256];
  size_t len = sizeof(buf);
  check(fi_getname(&ep_->fid, buf, &len), "fi_getname");
  name_.assign(buf, len);
  tx_ctx_.resize(4096);
  for (auto& c : tx_ctx_) free_ctx_.push_back(&c);
  // Posted receives, as many and as large as the engine's defaults.
  recv_mem_.resize(kRecvBuffers * kRecvBytes);
  recv_mr_ = register_memory(recv_mem_.data(), recv_mem_.size());
  rx_ctx_.resize(kRecvBuffers);
  for (auto& c : rx_ctx_) repost(&c);
}

RawFabric::~RawFabric() {
  if (ep_) fi_close(&ep_->fid);
  if (recv_mr_.mr) fi_close(&recv_mr_.mr->fid);
  if (cq_) fi_close(&cq_->fid);
  if (av_) fi_close(&av_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (list_) fi_freeinfo(list_);
}

RawFabric::Mr RawFabric::register_memory(void* ptr, size_t size) {
  iovec iov{ptr, size};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  attr.requested_key = prov_key_ ? 0 : next_key_++;
  attr.iface = FI_HMEM_SYSTEM;
  Mr out;
  check(fi_mr_regattr(domain_, &attr, 0, &out.mr), "fi_mr_regattr");
  if (mr_endpoint_) {
    check(fi_mr_bind(out.mr, &ep_->fid, 0), "fi_mr_bind");
    check(fi_mr_enable(out.mr), "fi_mr_enable");
  }
  out.desc = fi_mr_desc(out.mr);
  out.key = fi_mr_key(out.mr);
  return out;
}

fi_addr_t RawFabric::insert(const std::string& name) {
  fi_addr_t a = FI_ADDR_UNSPEC;
  if (fi_av_insert(av_, name.data(), 1, &a, 0, nullptr) != 1)
    throw std::runtime_error("raw libfabric: fi_av_insert failed");
  return a;
}

void RawFabric::repost(fi_context2* c) {
  const size_t i = static_cast<size_t>(c - rx_ctx_.data());
  for (;;) {
    const ssize_t rc =
        fi_recv(ep_, recv_mem_.data() + i * kRecvBytes, kRecvBytes, recv_mr_.desc, FI_ADDR_UNSPEC, c);
    if (rc == 0) return;
    if (rc != -FI_EAGAIN) check(static_cast<int>(rc), "fi_recv");
    fi_cq_data_entry e[1];
    (void)fi_cq_read(cq_, e, 0);
  }
}

int RawFabric::poll() {
  fi_cq_data_entry entries[32];
  const ssize_t n = fi_cq_read(cq_, entries, 32);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    fi_cq_readerr(cq_, &err, 0);
    char buf[256] = {0};
    const char* d = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
    throw std::runtime_error(std::string("raw libfabric: completion error: ") +
                             fi_strerror(err.err) + " (" + (d ? d : "") + ")");
  }
  if (n < 0) check(static_cast<int>(n), "fi_cq_read");
  for (ssize_t i = 0; i < n; ++i) {
    const fi_cq_data_entry& e = entries[i];
    if (e.flags & FI_REMOTE_WRITE) {
      if (e.flags & FI_REMOTE_CQ_DATA) imms_[static_cast<uint32_t>(e.data)]++;
      if (rx_cq_data_ && e.op_context) repost(static_cast<fi_context2*>(e.op_context));
      continue;
    }
    auto* c = static_cast<fi_context2*>(e.op_context);
    if (!c) continue;
    if (e.flags & FI_RECV) {
      repost(c);
      continue;
    }
    free_ctx_.push_back(c);
    ++completed_;
  }
  return static_cast<int>(n);
}

// The engine waiter's loop, minus its queues: poll; once 200 polls in a row
// and 100 us found nothing (the engine's kSpinPolls and kSpinWindow, the
// window timed from the first idle poll), sleep 50 us per iteration (yield
// mode); a deadline checked every iteration (the clock read there times
// the window too).
template <class Pred>
void RawFabric::progress_until(Pred pred, const char* what) {
  auto now = std::chrono::steady_clock::now();
  const auto deadline = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double>(timeout_s_));
  while (!pred()) {
    if (yield_ && idle_ > 200 && now - quiet_ >= std::chrono::microseconds(100))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (poll())
      idle_ = 0;
    else if (idle_++ == 0)
      quiet_ = now;
    now = std::chrono::steady_clock::now();
    if (now > deadline) throw std::runtime_error(std::string("raw libfabric: timeout in ") + what);
  }
}

void RawFabric::write(const Remote& dst, uint64_t dst_offset, const void* buf, size_t len,
                      void* desc, bool has_imm, uint32_t imm) {
  if (free_ctx_.empty()) progress_until([&] { return !free_ctx_.empty(); }, "write (contexts)");
  fi_context2* c = free_ctx_.back();
  free_ctx_.pop_back();
  iovec iov{const_cast<void*>(buf), len};
  fi_rma_iov riov{dst.base + dst_offset, len, dst.key};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = dst.addr;
  msg.rma_iov = &riov;
  msg.rma_iov_count = 1;
  msg.context = c;
  msg.data = imm;
  const uint64_t flags = FI_COMPLETION | (has_imm ? FI_REMOTE_CQ_DATA : 0);
  for (;;) {
    const ssize_t rc = fi_writemsg(ep_, &msg, flags);
    if (rc == 0) break;
    if (rc != -FI_EAGAIN) check(static_cast<int>(rc), "fi_writemsg");
    idle_ = poll() ? 0 : idle_;
  }
  ++posted_;
  idle_ = 0;
}

void RawFabric::wait_ops(size_t n) {
  while (ops_.size() > n) {
    const uint64_t need = ops_.front();
    progress_until([&] { return completed_ >= need; }, "wait for local completion");
    ops_.pop_front();
  }
}

void RawFabric::wait_imm(uint32_t imm, uint64_t n) {
  uint64_t& count = imms_[imm];
  progress_until([&] { return count >= n; }, "wait for immediate");
  count -= n;
}

}  // namespace moelink_fabric_bench
