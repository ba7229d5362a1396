// libfabric as a TransferEngine transport: fi_getinfo with the engine's
// needs, one domain with its endpoint, posting and completion
// classification. Honours what fi_getinfo returns: FI_MR_VIRT_ADDR (remote
// addresses are virtual addresses, else offsets), FI_MR_PROV_KEY (provider
// keys, else our own), FI_MR_ENDPOINT (bind registrations to the endpoint),
// FI_MR_LOCAL (pass descriptors for local buffers) and FI_RX_CQ_DATA (remote
// CQ data consumes a posted receive).
//
// Completion classification (never by length): an entry with FI_REMOTE_WRITE
// is a peer's write carrying an immediate (counted; under FI_RX_CQ_DATA it
// consumed a posted receive, which is reposted); an entry with FI_RECV is a
// two-sided message; anything else is one of the worker's work requests,
// found through its context.
#include "fabric/fabric_domain.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstring>
#include <functional>
#include <set>

#include "fabric/cuda_dmabuf.h"

namespace moelink::fabric {

// Features newer than Debian 12's libfabric 1.17 are compiled only against
// headers that have them, and used only when the loaded library has them.
#define MOELINK_FI_HEADERS_AT_LEAST(maj, min) \
  (FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) >= FI_VERSION(maj, min))

// The worker's contexts carry libfabric's per-operation space at their front.
static_assert(sizeof(fi_context2) <= sizeof(WrContext::transport_space),
              "WrContext must hold an fi_context2");

void check_fi(int rc, const std::string& what) {
  if (rc < 0) throw FabricError(what + ": " + fi_strerror(-rc) + " (" + std::to_string(rc) + ")");
}

ProviderInfo::~ProviderInfo() {
  if (list) fi_freeinfo(list);
}

namespace {

// efa-direct: the EFA provider's fabric without its RDM protocol layer
// (device RDMA only, no emulation), selected by fabric name; libfabric
// offers it from 2.1 (the EFA installer's builds; Debian 12 has 1.17).
constexpr char kEfaDirect[] = "efa-direct";
constexpr uint32_t kEfaDirectVersion = FI_VERSION(2, 1);

std::string prov_hint(const std::string& provider) {
  if (provider == "tcp") return "tcp;ofi_rxm";
  if (provider == "verbs") return "verbs;ofi_rxm";
  if (provider == kEfaDirect) return "efa";
  return provider;
}

fi_info* getinfo(const std::string& provider, bool hmem) {
  fi_info* hints = fi_allocinfo();
  if (!hints) throw FabricError("fi_allocinfo failed");
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
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(prov_hint(provider).c_str());
  if (provider == kEfaDirect) hints->fabric_attr->name = strdup(kEfaDirect);
  fi_info* info = nullptr;
  const int rc = fi_getinfo(fi_version(), nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  if (rc != 0) return nullptr;
  // The engine needs 4 bytes of remote CQ data (the immediate).
  fi_info* keep = nullptr;
  fi_info** tail = &keep;
  for (fi_info* i = info; i;) {
    fi_info* next = i->next;
    i->next = nullptr;
    if (i->domain_attr->cq_data_size >= 4) {
      *tail = i;
      tail = &i->next;
    } else {
      fi_freeinfo(i);
    }
    i = next;
  }
  return keep;
}

}  // namespace

std::unique_ptr<ProviderInfo> query_provider(const std::string& provider) {
  const std::vector<std::string> candidates =
      provider.empty() ? std::vector<std::string>{"efa", "shm", "tcp"}
                       : std::vector<std::string>{provider};
  if (provider == kEfaDirect && fi_version() < kEfaDirectVersion)
    throw ProviderUnavailable("TransferEngine: provider 'efa-direct' needs libfabric >= 2.1; the "
                              "loaded libfabric is " + fabric_runtime_version() +
                              " (use 'efa', or the EFA installer's libfabric)");
  for (const auto& p : candidates) {
    for (bool hmem : {true, false}) {
      fi_info* list = getinfo(p, hmem);
      if (!list) continue;
      auto pi = std::make_unique<ProviderInfo>();
      pi->list = list;
      pi->hmem = hmem;
      std::set<std::string> seen;
      const std::string want = prov_hint(p);
      for (fi_info* i = list; i; i = i->next) {
        // "tcp" may also match e.g. "tcp" without rxm; keep the exact stack.
        if (want != i->fabric_attr->prov_name) continue;
        // "efa" is the RDM protocol fabric; efa-direct only when asked for.
        const bool direct = i->fabric_attr->name && std::string(i->fabric_attr->name) == kEfaDirect;
        if (direct != (p == kEfaDirect)) continue;
        if (seen.insert(i->domain_attr->name).second) pi->domains.push_back(i);
      }
      if (pi->domains.empty()) continue;
      return pi;
    }
  }
  throw ProviderUnavailable("TransferEngine: libfabric provider '" +
                            (provider.empty() ? std::string("efa|shm|tcp") : provider) +
                            "' is not available with RDM endpoints, FI_MSG|FI_RMA and remote CQ "
                            "data (libfabric " + fabric_runtime_version() + ")");
}

Domain::Domain(const fi_info* info, int index, const ReceiveConfig& rx) : Nic(index) {
  info_ = fi_dupinfo(info);
  if (!info_) throw FabricError("fi_dupinfo failed");
  provider_ = info_->fabric_attr->prov_name;
  if (info_->fabric_attr->name && std::string(info_->fabric_attr->name) == kEfaDirect)
    provider_ = kEfaDirect;  // what the engine reports and checks
  const uint64_t mr_mode = info_->domain_attr->mr_mode;
  virt_addr_ = mr_mode & FI_MR_VIRT_ADDR;
  prov_key_ = mr_mode & FI_MR_PROV_KEY;
  mr_endpoint_ = mr_mode & FI_MR_ENDPOINT;
  mr_local_ = mr_mode & FI_MR_LOCAL;
  rx_cq_data_ = info_->mode & FI_RX_CQ_DATA;
  hmem_ = info_->caps & FI_HMEM;
  const std::string where = "TransferEngine domain " + std::to_string(index) + " (" + provider_ + ")";
  try {
    check_fi(fi_fabric(info_->fabric_attr, &fabric_, nullptr), where + ": fi_fabric");
    check_fi(fi_domain(fabric_, info_, &domain_, nullptr), where + ": fi_domain");
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    check_fi(fi_av_open(domain_, &av_attr, &av_, nullptr), where + ": fi_av_open");
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    check_fi(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), where + ": fi_cq_open");
    check_fi(fi_endpoint(domain_, info_, &ep_, nullptr), where + ": fi_endpoint");
#if MOELINK_FI_HEADERS_AT_LEAST(1, 18)
    // EFA: the provider must not call CUDA itself (NCCL-style deadlocks);
    // only where both the headers and the loaded library know the option.
    if (hmem_ && fi_version() >= FI_VERSION(1, 18) && (provider_ == "efa" || provider_ == kEfaDirect)) {
      bool permitted = false;
      (void)fi_setopt(&ep_->fid, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, &permitted,
                      sizeof(permitted));
    }
#endif
    check_fi(fi_ep_bind(ep_, &av_->fid, 0), where + ": fi_ep_bind(av)");
    check_fi(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), where + ": fi_ep_bind(cq)");
    check_fi(fi_enable(ep_), where + ": fi_enable");
    char buf[256];
    size_t len = sizeof(buf);
    check_fi(fi_getname(&ep_->fid, buf, &len), where + ": fi_getname");
    name_.assign(buf, len);
    post_receives(rx);
  } catch (...) {
    cleanup();
    throw;
  }
}

void Domain::post_receives(const ReceiveConfig& rx) {
  recv_bytes_ = rx.max_message_bytes;
  const size_t n = static_cast<size_t>(rx.recv_buffers);
  recv_memory_.resize(n * recv_bytes_);
  recv_mr_ = register_memory(recv_memory_.data(), recv_memory_.size(), MemoryKind::kHost, 0);
  recv_ctxs_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    recv_ctxs_[i].buf = recv_memory_.data() + i * recv_bytes_;
    repost(&recv_ctxs_[i]);
  }
}

void Domain::close_endpoint() {
  if (ep_) fi_close(&ep_->fid);
  ep_ = nullptr;
  deregister_memory(recv_mr_);  // after the endpoint it may be bound to
  recv_mr_ = MemoryHandle{};
}

Domain::~Domain() { cleanup(); }

void Domain::cleanup() {
  close_endpoint();
  if (cq_) fi_close(&cq_->fid);
  if (av_) fi_close(&av_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  cq_ = nullptr;
  av_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

bool Domain::register_dmabuf(void* ptr, size_t size, int device, uint64_t key, fid_mr** mr,
                             std::string* why) {
#if defined(FI_MR_DMABUF) && MOELINK_FI_HEADERS_AT_LEAST(1, 20)
  // Headers that know FI_MR_DMABUF; the loaded library must too (a newer
  // header set can meet an older libfabric.so at run time).
  if (fi_version() < FI_VERSION(1, 20)) {
    *why = "the loaded libfabric is older than 1.20";
    return false;
  }
  auto range = export_cuda_dmabuf(ptr, size, why);
  if (!range) return false;
  fi_mr_dmabuf dmabuf{};
  dmabuf.fd = range->fd;
  dmabuf.offset = range->offset;
  dmabuf.len = size;
  // The region's virtual address is base_addr + offset = ptr, so remote
  // addresses stay those of the FI_HMEM path (remote_base below).
  dmabuf.base_addr = range->base;
  fi_mr_attr attr{};
  attr.dmabuf = &dmabuf;
  attr.iov_count = 1;
  attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  attr.requested_key = key;
  attr.iface = FI_HMEM_CUDA;
  attr.device.cuda = device;
  const int rc = fi_mr_regattr(domain_, &attr, FI_MR_DMABUF, mr);
  close_dmabuf(*range);  // the registration holds its own reference to the dma-buf
  if (rc < 0) {
    *why = std::string("fi_mr_regattr(FI_MR_DMABUF): ") + fi_strerror(-rc);
    *mr = nullptr;
    return false;
  }
  return true;
#else
  (void)ptr;
  (void)size;
  (void)device;
  (void)key;
  (void)mr;
  *why = "libfabric headers older than 1.20 (no FI_MR_DMABUF)";
  return false;
#endif
}

MemoryHandle Domain::register_memory(void* ptr, size_t size, MemoryKind kind, int device) {
  const std::string where = "TransferEngine register_memory on domain " + std::to_string(index_);
  if (kind == MemoryKind::kCuda && !hmem_)
    throw FabricError(where + ": provider " + provider_ +
                      " did not accept FI_HMEM; CUDA memory cannot be registered");
  const uint64_t key = prov_key_ ? 0 : next_key_++;
  fid_mr* mr = nullptr;
  // CUDA memory: DMA-BUF first (the provider then needs no CUDA calls of its
  // own to pin the pages), else the FI_HMEM iface path. Why DMA-BUF was not
  // used is not an error: the iface path is the fallback.
  std::string dmabuf_why;
  if (kind != MemoryKind::kCuda || !register_dmabuf(ptr, size, device, key, &mr, &dmabuf_why)) {
    iovec iov{ptr, size};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    attr.requested_key = key;
    attr.iface = kind == MemoryKind::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (kind == MemoryKind::kCuda) attr.device.cuda = device;
    check_fi(fi_mr_regattr(domain_, &attr, 0, &mr), where + ": fi_mr_regattr");
  }
  if (mr_endpoint_) {
    int rc = fi_mr_bind(mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
    if (rc < 0) {
      fi_close(&mr->fid);
      check_fi(rc, where + ": fi_mr_bind/fi_mr_enable");
    }
  }
  MemoryHandle out;
  out.impl = mr;
  out.desc = fi_mr_desc(mr);
  out.key = fi_mr_key(mr);
  out.remote_base = virt_addr_ ? reinterpret_cast<uint64_t>(ptr) : 0;
  if (out.key == FI_KEY_NOTAVAIL) {
    fi_close(&mr->fid);
    throw FabricError(where + ": fi_mr_key not available");
  }
  return out;
}

void Domain::deregister_memory(const MemoryHandle& mr) {
  if (mr.impl) fi_close(&static_cast<fid_mr*>(mr.impl)->fid);
}

uint64_t Domain::insert_peer(const std::string& endpoint, const std::string&) {
  fi_addr_t addr = FI_ADDR_UNSPEC;
  const int n = fi_av_insert(av_, endpoint.data(), 1, &addr, 0, nullptr);
  if (n != 1)
    throw FabricError("TransferEngine add_peer: fi_av_insert on domain " + std::to_string(index_) +
                      " failed (" + std::to_string(n) + ")");
  return addr;
}

void Domain::repost(RecvCtx* c) {
  for (;;) {
    const ssize_t rc = fi_recv(ep_, c->buf, recv_bytes_, recv_mr_.desc, FI_ADDR_UNSPEC, &c->fi);
    if (rc == 0) return;
    if (rc != -FI_EAGAIN) check_fi(static_cast<int>(rc), "TransferEngine: fi_recv");
    fi_cq_data_entry e[1];
    (void)fi_cq_read(cq_, e, 0);  // progress
  }
}

Domain::RecvCtx* Domain::recv_ctx(void* op_context) {
  if (recv_ctxs_.empty()) return nullptr;
  const std::less<const void*> before;
  const void* first = recv_ctxs_.data();
  const void* end = recv_ctxs_.data() + recv_ctxs_.size();
  if (before(op_context, first) || !before(op_context, end)) return nullptr;
  return static_cast<RecvCtx*>(op_context);
}

PostStatus Domain::post(const Wr& wr, WrContext* ctx, bool, PostError* error) {
  void* context = ctx->transport_space;
  void* desc = wr.desc;
  ssize_t rc;
  if (wr.kind == Wr::Kind::kWrite) {
    // WR template: one local iov, one remote iov, the immediate as CQ data.
    iovec iov{wr.buf, wr.len};
    fi_rma_iov riov{wr.remote_addr, wr.len, wr.remote_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = wr.dest;
    msg.rma_iov = &riov;
    msg.rma_iov_count = 1;
    msg.context = context;
    msg.data = wr.imm;
    rc = fi_writemsg(ep_, &msg, FI_COMPLETION | (wr.has_imm ? FI_REMOTE_CQ_DATA : 0));
  } else {
    rc = fi_send(ep_, wr.buf, wr.len, desc, wr.dest, context);
  }
  if (rc == 0) return PostStatus::kPosted;
  if (rc == -FI_EAGAIN) return PostStatus::kAgain;
  error->timeout = false;
  error->text = fi_strerror(static_cast<int>(-rc));
  return PostStatus::kFailed;
}

// Completion errors that say the peer cannot be reached (rather than that
// one request was wrong, as a bad key or length): tcp;ofi_rxm fails what
// was in flight with FI_ECANCELED (provider text "Transport endpoint is not
// connected") and the next post with FI_ENOTCONN once the connection broke,
// then refuses posts for now while it reconnects to a process that is gone.
static bool peer_unreachable(int err) {
  switch (err) {
    case FI_ECANCELED:
    case FI_ENOTCONN:
    case FI_ECONNRESET:
    case FI_ECONNREFUSED:
    case FI_ECONNABORTED:
    case FI_ESHUTDOWN:
    case FI_ETIMEDOUT:
    case FI_EHOSTDOWN:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case EPIPE:  // fi_errno.h leaves FI_EPIPE out
      return true;
    default:
      return false;
  }
}

void Domain::handle_error(CompletionSink& sink) {
  fi_cq_err_entry err{};
  if (fi_cq_readerr(cq_, &err, 0) <= 0) return;
  if (!err.op_context) return;  // a peer's write that failed on our side
  if (err.flags & FI_REMOTE_WRITE) {  // under FI_RX_CQ_DATA it used a receive
    if (rx_cq_data_)
      if (RecvCtx* r = recv_ctx(err.op_context)) repost(r);
    return;
  }
  if (RecvCtx* r = recv_ctx(err.op_context)) {
    if (err.err != FI_ECANCELED) repost(r);
    return;
  }
  char buf[256] = {0};
  const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
  sink.wr_failed(reinterpret_cast<WrContext*>(err.op_context),
                 std::string(fi_strerror(err.err)) + " (" + (detail ? detail : "") + ")",
                 peer_unreachable(err.err));
}

int Domain::poll(CompletionSink& sink) {
  fi_cq_data_entry entries[32];
  const ssize_t n = fi_cq_read(cq_, entries, 32);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    handle_error(sink);
    return 1;
  }
  if (n < 0) return 0;
  for (ssize_t i = 0; i < n; ++i) {
    const fi_cq_data_entry& e = entries[i];
    if (e.flags & FI_REMOTE_WRITE) {
      if (e.flags & FI_REMOTE_CQ_DATA) sink.imm_arrived(static_cast<uint32_t>(e.data));
      if (rx_cq_data_ && e.op_context)
        if (RecvCtx* r = recv_ctx(e.op_context)) repost(r);
      continue;
    }
    if (!e.op_context) continue;
    if (e.flags & FI_RECV) {
      if (RecvCtx* r = recv_ctx(e.op_context)) {
        sink.message_arrived(r->buf, e.len);
        repost(r);
      }
      continue;
    }
    // transport_space is WrContext's first (and only) member.
    sink.wr_done(reinterpret_cast<WrContext*>(e.op_context));
  }
  return static_cast<int>(n);
}

}  // namespace moelink::fabric
