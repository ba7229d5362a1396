// libfabric setup: fi_getinfo with the engine's needs, and one domain with
// its endpoint. Honours what fi_getinfo returns: FI_MR_VIRT_ADDR (remote
// addresses are virtual addresses, else offsets), FI_MR_PROV_KEY (provider
// keys, else our own), FI_MR_ENDPOINT (bind registrations to the endpoint),
// FI_MR_LOCAL (pass descriptors for local buffers) and FI_RX_CQ_DATA (remote
// CQ data consumes a posted receive).
#include "fabric/fabric_domain.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>

#include <cstring>
#include <set>

namespace moelink::fabric {

// Features newer than Debian 12's libfabric 1.17 are compiled only against
// headers that have them, and used only when the loaded library has them.
#define MOELINK_FI_HEADERS_AT_LEAST(maj, min) \
  (FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) >= FI_VERSION(maj, min))

void check_fi(int rc, const std::string& what) {
  if (rc < 0) throw FabricError(what + ": " + fi_strerror(-rc) + " (" + std::to_string(rc) + ")");
}

ProviderInfo::~ProviderInfo() {
  if (list) fi_freeinfo(list);
}

namespace {

std::string prov_hint(const std::string& provider) {
  if (provider == "tcp") return "tcp;ofi_rxm";
  if (provider == "verbs") return "verbs;ofi_rxm";
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
        if (seen.insert(i->domain_attr->name).second) pi->domains.push_back(i);
      }
      if (pi->domains.empty()) continue;
      return pi;
    }
  }
  throw ProviderUnavailable("TransferEngine: libfabric provider '" +
                            (provider.empty() ? std::string("efa|shm|tcp") : provider) +
                            "' is not available with RDM endpoints, FI_MSG|FI_RMA and remote CQ "
                            "data (libfabric " +
                            std::to_string(FI_MAJOR(fi_version())) + "." +
                            std::to_string(FI_MINOR(fi_version())) + ")");
}

Domain::Domain(const fi_info* info, int index) : index_(index) {
  info_ = fi_dupinfo(info);
  if (!info_) throw FabricError("fi_dupinfo failed");
  provider_ = info_->fabric_attr->prov_name;
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
    if (hmem_ && fi_version() >= FI_VERSION(1, 18) && provider_ == "efa") {
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
  } catch (...) {
    cleanup();
    throw;
  }
}

void Domain::close_endpoint() {
  if (ep_) fi_close(&ep_->fid);
  ep_ = nullptr;
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

Domain::Mr Domain::register_memory(void* ptr, size_t size, MemoryKind kind, int device) {
  const std::string where = "TransferEngine register_memory on domain " + std::to_string(index_);
  if (kind == MemoryKind::kCuda && !hmem_)
    throw FabricError(where + ": provider " + provider_ +
                      " did not accept FI_HMEM; CUDA memory cannot be registered");
  iovec iov{ptr, size};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  attr.requested_key = prov_key_ ? 0 : next_key_++;
  attr.iface = kind == MemoryKind::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  if (kind == MemoryKind::kCuda) attr.device.cuda = device;
  // TODO(issue 3): DMA-BUF registration (FI_MR_DMABUF, libfabric >= 1.20)
  // guarded by MOELINK_FI_HEADERS_AT_LEAST(1, 20) and fi_version().
  Mr out;
  check_fi(fi_mr_regattr(domain_, &attr, 0, &out.mr), where + ": fi_mr_regattr");
  if (mr_endpoint_) {
    int rc = fi_mr_bind(out.mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(out.mr);
    if (rc < 0) {
      fi_close(&out.mr->fid);
      check_fi(rc, where + ": fi_mr_bind/fi_mr_enable");
    }
  }
  out.desc = fi_mr_desc(out.mr);
  out.key = fi_mr_key(out.mr);
  if (out.key == FI_KEY_NOTAVAIL) {
    fi_close(&out.mr->fid);
    throw FabricError(where + ": fi_mr_key not available");
  }
  return out;
}

void Domain::close_mr(const Mr& mr) {
  if (mr.mr) fi_close(&mr.mr->fid);
}

fi_addr_t Domain::insert_address(const std::string& name) {
  fi_addr_t addr = FI_ADDR_UNSPEC;
  const int n = fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr);
  if (n != 1)
    throw FabricError("TransferEngine add_peer: fi_av_insert on domain " + std::to_string(index_) +
                      " failed (" + std::to_string(n) + ")");
  return addr;
}

}  // namespace moelink::fabric
