// One libfabric domain (one NIC) as a TransferEngine transport (transport.h):
// fabric, domain, address vector, completion queue and one RDM endpoint,
// what fi_getinfo said about memory registration, and the posted receive
// buffers for two-sided messages. After construction it is only called
// under its worker's endpoint lock (the domain is opened FI_THREAD_DOMAIN).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fabric/transport.h"
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

class Domain final : public Nic {
 public:
  // Opens everything and posts rx.recv_buffers receives.
  Domain(const fi_info* info, int index, const ReceiveConfig& rx);
  ~Domain() override;
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  const std::string& provider() const override { return provider_; }
  const std::string& endpoint() const override { return name_; }
  bool hmem() const override { return hmem_; }

  MemoryHandle register_memory(void* ptr, size_t size, MemoryKind kind, int device) override;
  void deregister_memory(const MemoryHandle& mr) override;
  uint64_t insert_peer(const std::string& endpoint, const std::string& peer_name) override;

  PostStatus post(const Wr& wr, WrContext* ctx, bool more, PostError* error) override;
  void flush() override {}  // every post is its own fi_writemsg / fi_send
  int poll(CompletionSink& sink) override;
  // Closes the endpoint (outstanding operations are abandoned), then the
  // receive buffers' registration.
  void close_endpoint() override;

 private:
  struct RecvCtx {
    fi_context2 fi;  // first: libfabric's FI_CONTEXT2 space
    char* buf = nullptr;
  };
  void cleanup();
  void post_receives(const ReceiveConfig& rx);
  void repost(RecvCtx* c);
  RecvCtx* recv_ctx(void* op_context);  // null when it is not one of ours
  void handle_error(CompletionSink& sink);
  // FI_MR_DMABUF registration of CUDA memory; false (and *why) when it is
  // not possible here, so the caller falls back to FI_HMEM_CUDA.
  bool register_dmabuf(void* ptr, size_t size, int device, uint64_t key, fid_mr** mr,
                       std::string* why);

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
  // Receive buffers for two-sided messages (and, under FI_RX_CQ_DATA, for
  // remote writes with data), reposted after every completion.
  size_t recv_bytes_ = 0;
  std::vector<char> recv_memory_;
  MemoryHandle recv_mr_;
  std::vector<RecvCtx> recv_ctxs_;
};

}  // namespace moelink::fabric
