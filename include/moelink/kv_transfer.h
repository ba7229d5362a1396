// KV-cache transfer over the TransferEngine: moves the pages of one request's
// paged KV cache from a prefill engine to a decode engine with paged RDMA
// writes; the decode side learns of completion through immediate counters.
// See docs/transfer_engine.md ("KV-cache transfer") for the protocol.
//
// Layout model: the cache holds `num_layers` planes; in each plane a page
// ("block") holds `tokens_per_page` tokens of `bytes_per_token` bytes each,
// contiguous. Page p of layer l starts at
//   base_offset + l * layer_stride + p * page_stride
// of the registered region. Layer-major (vLLM: one [num_pages, page] tensor
// per layer) and page-major (all layers of a page together) are both
// expressible; K and V kept in separate planes are modelled as 2 * layers
// planes of half the bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moelink/transfer_engine.h"

namespace moelink::fabric {

struct KvCacheLayout {
  int num_layers = 0;
  uint64_t bytes_per_token = 0;  // per layer (DeepSeek-V3: 70,272 / 61 = 1,152)
  uint32_t tokens_per_page = 0;  // DeepSeek-V3 serving: 64
  uint64_t num_pages = 0;        // pages (blocks) per layer in this cache
  uint64_t base_offset = 0;      // bytes from the start of the registration
  uint64_t layer_stride = 0;     // bytes between layers; 0 = layer-major default
  uint64_t page_stride = 0;      // bytes between pages of a layer; 0 = page_bytes()

  uint64_t page_bytes() const { return bytes_per_token * tokens_per_page; }
  // Strides with the defaults (0) resolved.
  uint64_t effective_page_stride() const;
  uint64_t effective_layer_stride() const;
  uint64_t page_offset(int layer, uint64_t page) const;
  // Bytes of the registration the layout covers (base_offset included).
  uint64_t required_bytes() const;
  // Throws InvalidArgument naming `what` and the field when the layout is
  // empty, overflows, or has pages that overlap (strides must keep the pages
  // of different layers and pages apart).
  void validate(const std::string& what) const;

  // Layer-major: layer l is one contiguous [num_pages, page_bytes] array.
  static KvCacheLayout layer_major(int num_layers, uint64_t bytes_per_token,
                                   uint32_t tokens_per_page, uint64_t num_pages);
  // Page-major: page p holds all layers, [num_pages, num_layers, page_bytes].
  static KvCacheLayout page_major(int num_layers, uint64_t bytes_per_token,
                                  uint32_t tokens_per_page, uint64_t num_pages);
};

// How the writes of one request are announced to the decode side.
enum class KvImmMode {
  // Immediate imm_base + l for layer l: every write of layer l carries it, so
  // the decode side can wait for single layers (layer-wise pipelining). One
  // paged_write per layer (+ one write per layer for a partial last page).
  kPerLayer,
  // Immediate imm_base for every write of the request: one paged_write for
  // all full pages of all layers (+ one for the partial last pages).
  kPerRequest,
};

struct KvTransferRequest {
  uint64_t num_tokens = 0;
  // Block ids of the request's pages on each side, in token order; both have
  // ceil(num_tokens / tokens_per_page) entries. The last page carries
  // num_tokens - (pages - 1) * tokens_per_page tokens; only those bytes are
  // written.
  std::vector<uint64_t> src_pages;
  std::vector<uint64_t> dst_pages;
  // Immediates imm_base .. imm_base + num_layers - 1 (kPerLayer) or imm_base
  // alone (kPerRequest) belong to this request until the decode side's wait
  // returns: requests in flight to the same decode engine need disjoint ones.
  uint32_t imm_base = 0;
  KvImmMode imm_mode = KvImmMode::kPerLayer;

  uint64_t num_pages(uint32_t tokens_per_page) const;
};

// Number of writes (= immediate counts) that layer `layer` of `req` produces.
// The same on both sides: the decode side derives what it waits for from it.
uint64_t kv_writes_per_layer(const KvCacheLayout& layout, const KvTransferRequest& req);
// Bytes of one request (all layers).
uint64_t kv_request_bytes(const KvCacheLayout& layout, const KvTransferRequest& req);

// Checks a request against both layouts (same num_layers, bytes_per_token and
// tokens_per_page; page counts; page ids in range; no destination page twice;
// immediates within 32 bits). Throws InvalidArgument naming the side, the
// request page and the id. Called by write_kv_cache; the decode side may call
// it before publishing its page list.
void validate_kv_request(const KvCacheLayout& src, uint64_t src_bytes, const KvCacheLayout& dst,
                         uint64_t dst_bytes, const KvTransferRequest& req,
                         const std::string& what = "KV transfer");

// Prefill side: writes layers [first_layer, first_layer + num_layers) of the
// request (num_layers < 0: to the last layer) from `src` (laid out as
// src_layout) to the decode cache `dst` (dst_layout). Call it once for all
// layers, or layer by layer as prefill produces them. The returned Transfer
// completes when every write has completed locally (the source pages may
// then be reused); it fails with the engine's error (FabricError /
// TimeoutError naming the peer). Invalid requests throw InvalidArgument and
// post nothing.
TransferPtr write_kv_cache(TransferEngine& engine, const MemoryRegion& src,
                           const KvCacheLayout& src_layout, const MemoryDescriptor& dst,
                           const KvCacheLayout& dst_layout, const KvTransferRequest& req,
                           int first_layer = 0, int num_layers = -1, Callback cb = {});

// Decode side: returns once every page of layers [first_layer, first_layer +
// num_layers) of the request has arrived (immediate counts consumed). With
// kPerRequest only the whole request can be waited for (first_layer 0,
// num_layers < 0 or all). Throws TimeoutError naming `peer` (the prefill
// engine's name), the layer and the pages seen when not all arrived within
// timeout_s (< 0: 30 s), e.g. when the prefill process died.
void wait_kv_cache(TransferEngine& engine, const KvCacheLayout& dst_layout,
                   const KvTransferRequest& req, const std::string& peer, double timeout_s = -1,
                   int first_layer = 0, int num_layers = -1);

}  // namespace moelink::fabric
