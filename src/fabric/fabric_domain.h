// One libfabric domain (one NIC): fabric, domain, address vector, completion
// queue and one RDM endpoint, plus what fi_getinfo said about memory
// registration. After construction it is only called under its worker's
// endpoint mutex (by the worker or by a user thread posting/polling, see
// worker.h): the domain is opened FI_THREAD_DOMAIN.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moelink/transfer_engine.h"

namespace moelink::fabric {

// Throws FabricError "<what>: <fi_strerror>" when rc < 0.
void check_fi(int rc, const std::string& what);

// fi_getinfo results for one provider; owns the list.
struct ProviderInfo {
  fi_info* list = nullptr;
  bool hmem = false;
  std::vector<fi_info*> domains;  // one entry per distinct domain (NIC)
  ~ProviderInfo();
};
// Tries FI_HMEM first, then host memory only. Throws ProviderUnavailable.
std::unique_ptr<ProviderInfo> query_provider(const std::string& provider);

class Domain {
 public:
  Domain(const fi_info* info, int index);
  ~Domain();
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  struct Mr {
    fid_mr* mr = nullptr;
    void* desc = nullptr;
    uint64_t key = 0;
  };
  // Registers [ptr, ptr+size) for local use and remote writes.
  Mr register_memory(void* ptr, size_t size, MemoryKind kind, int device);
  static void close_mr(const Mr& mr);
  // Remote address for offset 0 of a registration at ptr.
  uint64_t remote_base(const void* ptr) const {
    return virt_addr_ ? reinterpret_cast<uint64_t>(ptr) : 0;
  }
  fi_addr_t insert_address(const std::string& name);

  int index() const { return index_; }
  const std::string& name() const { return name_; }
  const std::string& provider() const { return provider_; }
  fid_ep* ep() const { return ep_; }
  fid_cq* cq() const { return cq_; }
  bool mr_local() const { return mr_local_; }
  bool rx_cq_data() const { return rx_cq_data_; }
  // Closes the endpoint (outstanding operations are abandoned).
  void close_endpoint();

 private:
  void cleanup();
  int index_;
  std::string provider_;
  bool virt_addr_ = false, prov_key_ = false, mr_endpoint_ = false, mr_local_ = false;
  bool rx_cq_data_ = false;
  bool hmem_ = false;
  uint64_t next_key_ = 1;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::string name_;
};

}  // namespace moelink::fabric
