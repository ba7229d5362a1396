#include "fabric_binding.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "moelink/errors.h"

#if defined(MOELINK_WITH_FABRIC)
#include "moelink/kv_transfer.h"
#include "moelink/transfer_engine.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {

#if !defined(MOELINK_WITH_FABRIC)

void bind_fabric(nb::module_&) {}

#else

namespace {

using fabric::KvCacheLayout;
using fabric::KvImmMode;
using fabric::KvTransferRequest;
using fabric::MemoryDescriptor;
using fabric::MemoryRegion;
using fabric::TransferPtr;

KvImmMode imm_mode_from_name(const std::string& s) {
  if (s == "layer") return KvImmMode::kPerLayer;
  if (s == "request") return KvImmMode::kPerRequest;
  throw InvalidArgument("moelink: imm_mode '" + s + "' is not one of 'layer', 'request'");
}

const char* imm_mode_name(KvImmMode m) { return m == KvImmMode::kPerLayer ? "layer" : "request"; }

// A registration keeps its memory alive until it is deregistered or the
// engine closes: host memory by keeping the Python buffer exported (numpy
// then refuses to resize or free it), CUDA memory by referencing the array.
struct Registration {
  MemoryRegion region;
  Py_buffer view{};  // view.obj: set while exported (PyBuffer_Release clears it)
  nb::object array;  // a CUDA array
  void release() {
    if (view.obj != nullptr) PyBuffer_Release(&view);
    array = nb::object();
  }
};

// The CUDA device of a DLPack array on one (its __dlpack_device__ says
// kDLCUDA, 2), else -1: host memory goes through the buffer protocol.
inline int cuda_device_of(nb::handle buffer) {
  if (!nb::hasattr(buffer, "__dlpack_device__")) return -1;
  const nb::tuple dev = nb::cast<nb::tuple>(buffer.attr("__dlpack_device__")());
  return nb::cast<int>(dev[0]) == 2 ? nb::cast<int>(dev[1]) : -1;
}

class PyTransfer {
 public:
  explicit PyTransfer(TransferPtr t) : t_(std::move(t)) {}
  bool done() const { return t_->done(); }
  void wait(double timeout_s) const {
    nb::gil_scoped_release release;
    t_->wait(timeout_s);
  }

 private:
  TransferPtr t_;
};

class PyTransferEngine {
 public:
  PyTransferEngine(const std::string& provider, const std::string& name, double timeout_s,
                   bool busy_poll, int num_domains, std::vector<int> worker_cpus) {
    fabric::EngineOptions o;
    o.provider = provider;
    o.name = name;
    o.timeout_s = timeout_s;
    o.yield_when_idle = !busy_poll;
    o.num_domains = num_domains;
    o.worker_cpus = std::move(worker_cpus);
    nb::gil_scoped_release release;
    engine_ = fabric::TransferEngine::create(o);
  }
  ~PyTransferEngine() { close(); }

  fabric::TransferEngine& engine() const {
    if (!engine_) throw InvalidArgument("moelink: the TransferEngine is closed");
    return *engine_;
  }

  MemoryRegion register_memory(nb::handle buffer) {
    auto reg = std::make_unique<Registration>();
    const int device = cuda_device_of(buffer);
    if (device >= 0) {
      // GPU memory (a torch CUDA tensor, e.g. Model.kv_cache_region on a GPU
      // backend): registered with FI_HMEM, the provider permitting.
      nb::ndarray<nb::c_contig> a;
      if (!nb::try_cast(buffer, a))
        throw InvalidArgument("moelink: register_memory: a CUDA array must be C-contiguous");
      if (a.nbytes() == 0) throw InvalidArgument("moelink: register_memory: the buffer is empty");
      reg->region = engine().register_memory(a.data(), a.nbytes(), fabric::MemoryKind::kCuda, device);
      reg->array = nb::borrow(buffer);
    } else {
      if (PyObject_GetBuffer(buffer.ptr(), &reg->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        throw InvalidArgument("moelink: register_memory needs a writable C-contiguous buffer "
                              "(a numpy array, bytearray, ...) or a CUDA array (DLPack), got " +
                              nb::cast<std::string>(buffer.type().attr("__name__")));
      }
      if (reg->view.len <= 0) {
        reg->release();
        throw InvalidArgument("moelink: register_memory: the buffer is empty");
      }
      try {
        reg->region = engine().register_memory(reg->view.buf, static_cast<size_t>(reg->view.len));
      } catch (...) {
        reg->release();
        throw;
      }
    }
    const MemoryRegion r = reg->region;
    registrations_.emplace(r.id, std::move(reg));
    return r;
  }

  void deregister_memory(const MemoryRegion& r) {
    auto it = registrations_.find(r.id);
    if (it == registrations_.end())
      throw InvalidArgument("moelink: deregister_memory: region " + std::to_string(r.id) +
                            " is not registered with this engine");
    engine().deregister_memory(it->second->region);
    it->second->release();
    registrations_.erase(it);
  }

  const MemoryRegion& registered(const MemoryRegion& r, const char* what) const {
    auto it = registrations_.find(r.id);
    if (it == registrations_.end())
      throw InvalidArgument(std::string("moelink: ") + what + ": region " + std::to_string(r.id) +
                            " is not registered with this engine");
    return it->second->region;
  }

  void close() {
    if (!engine_) return;
    for (auto& [id, reg] : registrations_) {
      try {
        engine_->deregister_memory(reg->region);
      } catch (...) {
      }
      reg->release();
    }
    registrations_.clear();
    nb::gil_scoped_release release;
    engine_.reset();
  }

 private:
  std::unique_ptr<fabric::TransferEngine> engine_;
  std::unordered_map<uint64_t, std::unique_ptr<Registration>> registrations_;
};

nb::bytes to_bytes(const std::vector<char>& v) { return nb::bytes(v.data(), v.size()); }

}  // namespace

void bind_fabric(nb::module_& m) {
  nb::class_<MemoryRegion>(m, "MemoryRegion",
                           "A local registration (TransferEngine.register_memory).")
      .def_ro("id", &MemoryRegion::id)
      .def_ro("size", &MemoryRegion::size)
      .def_prop_ro("address", [](const MemoryRegion& r) { return reinterpret_cast<uintptr_t>(r.ptr); })
      .def("__repr__", [](const MemoryRegion& r) {
        return "MemoryRegion(id=" + std::to_string(r.id) + ", size=" + std::to_string(r.size) + ")";
      });

  nb::class_<MemoryDescriptor>(
      m, "MemoryDescriptor",
      "What a peer needs to write into a registration: send descriptor() bytes to it out of "
      "band; it calls MemoryDescriptor.from_bytes.")
      .def_static(
          "from_bytes",
          [](nb::bytes b) { return MemoryDescriptor::deserialize(b.c_str(), b.size()); }, "data"_a)
      .def("to_bytes", [](const MemoryDescriptor& d) { return to_bytes(d.serialize()); })
      .def_prop_ro("name", [](const MemoryDescriptor& d) { return d.owner.name; },
                   "the owning engine's name (TransferEngine(name=...))")
      .def_ro("size", &MemoryDescriptor::size);

  nb::class_<PyTransfer>(m, "Transfer", "An operation in flight.")
      .def("done", &PyTransfer::done)
      .def("wait", &PyTransfer::wait, "timeout_s"_a = -1.0,
           "Waits (without the GIL) for completion; raises the operation's error. timeout_s < 0: "
           "the engine's timeout.");

  nb::class_<KvCacheLayout>(
      m, "KvCacheLayout",
      "A paged KV cache: num_layers planes of num_pages pages of tokens_per_page tokens of "
      "bytes_per_token bytes (per layer). Page p of layer l starts at base_offset + l * "
      "layer_stride + p * page_stride (0 strides: the defaults of the layout kind).")
      .def(nb::init<>())
      .def_static("layer_major", &KvCacheLayout::layer_major, "num_layers"_a, "bytes_per_token"_a,
                  "tokens_per_page"_a, "num_pages"_a,
                  "Layer l is one contiguous [num_pages, page_bytes] array (vLLM's layout).")
      .def_static("page_major", &KvCacheLayout::page_major, "num_layers"_a, "bytes_per_token"_a,
                  "tokens_per_page"_a, "num_pages"_a,
                  "Page p holds all layers: [num_pages, num_layers, page_bytes].")
      .def_rw("num_layers", &KvCacheLayout::num_layers)
      .def_rw("bytes_per_token", &KvCacheLayout::bytes_per_token)
      .def_rw("tokens_per_page", &KvCacheLayout::tokens_per_page)
      .def_rw("num_pages", &KvCacheLayout::num_pages)
      .def_rw("base_offset", &KvCacheLayout::base_offset)
      .def_rw("layer_stride", &KvCacheLayout::layer_stride)
      .def_rw("page_stride", &KvCacheLayout::page_stride)
      .def_prop_ro("page_bytes", &KvCacheLayout::page_bytes)
      .def_prop_ro("required_bytes", &KvCacheLayout::required_bytes)
      .def("page_offset", &KvCacheLayout::page_offset, "layer"_a, "page"_a)
      .def("validate", &KvCacheLayout::validate, "what"_a = "KvCacheLayout");

  nb::class_<KvTransferRequest>(
      m, "KvTransferRequest",
      "One request's pages: src_pages / dst_pages are the block ids on each side in token order "
      "(ceil(num_tokens / tokens_per_page) each; sources may repeat, destinations may not). "
      "Requests in flight to one decode engine need disjoint immediates: imm_base .. imm_base + "
      "num_layers - 1 (imm_mode 'layer') or imm_base ('request').")
      .def(
          "__init__",
          [](KvTransferRequest* r, uint64_t num_tokens, std::vector<uint64_t> src_pages,
             std::vector<uint64_t> dst_pages, uint32_t imm_base, const std::string& imm_mode) {
            new (r) KvTransferRequest();
            r->num_tokens = num_tokens;
            r->src_pages = std::move(src_pages);
            r->dst_pages = std::move(dst_pages);
            r->imm_base = imm_base;
            r->imm_mode = imm_mode_from_name(imm_mode);
          },
          "num_tokens"_a, "src_pages"_a, "dst_pages"_a, "imm_base"_a = 0, "imm_mode"_a = "layer")
      .def_rw("num_tokens", &KvTransferRequest::num_tokens)
      .def_rw("src_pages", &KvTransferRequest::src_pages)
      .def_rw("dst_pages", &KvTransferRequest::dst_pages)
      .def_rw("imm_base", &KvTransferRequest::imm_base)
      .def_prop_ro("imm_mode", [](const KvTransferRequest& r) { return imm_mode_name(r.imm_mode); })
      .def("num_pages", &KvTransferRequest::num_pages, "tokens_per_page"_a);

  m.def("kv_request_bytes", &fabric::kv_request_bytes, "layout"_a, "request"_a,
        "Bytes of one request, all layers.");

  nb::class_<PyTransferEngine>(
      m, "TransferEngine",
      "moelink's RDMA engine (libfabric: shm, tcp, efa, verbs; or 'ibverbs'). See "
      "docs/transfer_engine.md. Host memory only from Python.")
      .def(nb::init<const std::string&, const std::string&, double, bool, int, std::vector<int>>(),
           "provider"_a = "", "name"_a = "", "timeout_s"_a = 30.0, "busy_poll"_a = false,
           "num_domains"_a = 1, "worker_cpus"_a = std::vector<int>{})
      .def_prop_ro("provider", [](const PyTransferEngine& e) { return e.engine().provider(); })
      .def_prop_ro("name", [](const PyTransferEngine& e) { return e.engine().address().name; })
      .def_prop_ro("num_domains", [](const PyTransferEngine& e) { return e.engine().num_domains(); })
      .def("register_memory", &PyTransferEngine::register_memory, "buffer"_a,
           "Registers a writable C-contiguous host buffer (kept exported until deregistered) or a "
           "C-contiguous CUDA array with DLPack (e.g. a torch tensor on a GPU; kept referenced; the "
           "provider must accept FI_HMEM).")
      .def("deregister_memory", &PyTransferEngine::deregister_memory, "region"_a)
      .def(
          "descriptor",
          [](const PyTransferEngine& e, const MemoryRegion& r) {
            return to_bytes(e.engine().descriptor(e.registered(r, "descriptor")).serialize());
          },
          "region"_a, "Bytes to send to a peer that will write into this region.")
      .def(
          "add_peer_group",
          [](PyTransferEngine& e, const std::vector<MemoryDescriptor>& members) {
            return e.engine().add_peer_group(members);
          },
          "members"_a)
      .def(
          "barrier",
          [](PyTransferEngine& e, int group, uint32_t imm) {
            return PyTransfer(e.engine().barrier(group, imm));
          },
          "group"_a, "imm"_a, "A zero-byte write carrying imm to every member.")
      .def(
          "wait_imm",
          [](PyTransferEngine& e, uint32_t imm, uint64_t count, double timeout_s) {
            fabric::TransferEngine& eng = e.engine();
            nb::gil_scoped_release release;
            eng.wait_imm(imm, count, timeout_s);
          },
          "imm"_a, "count"_a, "timeout_s"_a = -1.0)
      .def(
          "write_kv_cache",
          [](PyTransferEngine& e, const MemoryRegion& src, const KvCacheLayout& src_layout,
             const MemoryDescriptor& dst, const KvCacheLayout& dst_layout,
             const KvTransferRequest& req, int first_layer, int num_layers) {
            const MemoryRegion& region = e.registered(src, "write_kv_cache");
            fabric::TransferEngine& eng = e.engine();
            nb::gil_scoped_release release;
            return PyTransfer(fabric::write_kv_cache(eng, region, src_layout, dst, dst_layout, req,
                                                     first_layer, num_layers));
          },
          "src"_a, "src_layout"_a, "dst"_a, "dst_layout"_a, "request"_a, "first_layer"_a = 0,
          "num_layers"_a = -1,
          "Prefill side: writes the request's pages of layers [first_layer, first_layer + "
          "num_layers) (num_layers < 0: to the last). The Transfer completes when the source "
          "pages may be reused.")
      .def(
          "wait_kv_cache",
          [](PyTransferEngine& e, const KvCacheLayout& dst_layout, const KvTransferRequest& req,
             const std::string& peer, double timeout_s, int first_layer, int num_layers) {
            fabric::TransferEngine& eng = e.engine();
            nb::gil_scoped_release release;
            fabric::wait_kv_cache(eng, dst_layout, req, peer, timeout_s, first_layer, num_layers);
          },
          "dst_layout"_a, "request"_a, "peer"_a, "timeout_s"_a = -1.0, "first_layer"_a = 0,
          "num_layers"_a = -1,
          "Decode side: returns (without the GIL) once every page of the layers has arrived; "
          "TimeoutError naming peer otherwise.")
      .def("close", &PyTransferEngine::close,
           "Deregisters everything and shuts the engine down (also on garbage collection).")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyTransferEngine& e, nb::args) { e.close(); });
}

#endif  // MOELINK_WITH_FABRIC

}  // namespace moelink::python
