// kInternode: the inter-node protocol (protocol.h) with GPU kernels packing
// and unpacking and the Proxy thread moving the bytes over the
// TransferEngine. Peers of the same node (Options.node_size) get their
// slots and rows over NVLink: the kernels store them into the peers' local
// areas (device memory mapped through CUDA IPC); node_size = 1 sends every
// peer through the engine (two GPUs of one host acting as two nodes).
//
// Buffers for other nodes are staged in pinned host memory mapped into the
// GPU, which any libfabric provider can register, or, with GPUDirect RDMA
// (Options.gpu_direct: providers that accept FI_HMEM), live in device
// memory the NIC reads and writes. The proxy's output (ready
// words and plan) goes to device memory through a GDRCopy mapping when
// libgdrapi and gdrdrv are there at run time (MOELINK_GDRCOPY=0 turns it
// off), else to pinned host memory. The handshake with the proxy goes through
// pinned words: after the pack kernels a one-thread kernel raises `request`
// to the step (from the device-side epoch); before the unpack kernels the
// stream waits for `dispatch_ready` / `combine_ready` == 1 and resets it
// (cuStreamWaitValue64 / cuStreamWriteValue64 with constants). The GPU holds
// no SM while the network works, and the whole sequence can be captured in
// a CUDA graph and replayed.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/all_to_all_impl.h"
#include "core/kernel_blocks.h"
#include "internode/gdr_memory.h"
#include "internode/gpu_kernels.h"
#include "internode/internode_impl.h"
#include "internode/protocol.h"
#include "internode/proxy.h"
#include "moelink/errors.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"
#include "nvlink/peer_memory.h"

namespace moelink::detail::internode {
namespace {

// pack_kernel keeps one int64 block offset per rank in shared memory.
constexpr int kMaxGpuWorldSize = 4096;

void check_driver(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  throw SystemError(std::string("moelink: internode: ") + what + " failed with CUresult " +
                    std::to_string(static_cast<int>(r)));
}

// The few driver calls used, looked up through the runtime, so that
// libmoelink does not link libcuda (absent where the build and the CPU tests
// run without a driver).
struct DriverCalls {
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
  CUresult (*wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
};

template <typename Fn>
void lookup(Fn* fn, const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  MOELINK_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || p == nullptr)
    throw SystemError(std::string("moelink: internode: the CUDA driver has no ") + name);
  *fn = reinterpret_cast<Fn>(p);
}

const DriverCalls& driver() {
  static const DriverCalls calls = [] {
    DriverCalls c{};
    lookup(&c.device_get, "cuDeviceGet");
    lookup(&c.device_attribute, "cuDeviceGetAttribute");
    lookup(&c.write_value64, "cuStreamWriteValue64");
    lookup(&c.wait_value64, "cuStreamWaitValue64");
    return c;
  }();
  return calls;
}

// Pinned host memory mapped into the GPU.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(int64_t bytes) : bytes_(bytes) {
    MOELINK_CUDA_CHECK(cudaHostAlloc(&host_, static_cast<size_t>(bytes),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host_, 0, static_cast<size_t>(bytes));
    MOELINK_CUDA_CHECK(cudaHostGetDevicePointer(&device_, host_, 0));
  }
  ~PinnedBuffer() { cudaFreeHost(host_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  template <typename T = char>
  T* host() const {
    return static_cast<T*>(host_);
  }
  template <typename T = char>
  T* device() const {
    return static_cast<T*>(device_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
  int64_t bytes_;
};

// A send or receive buffer: pinned host memory mapped into the GPU (host
// staging) or device memory registered for GPUDirect RDMA. Zeroed.
class FabricBuffer {
 public:
  FabricBuffer(int64_t bytes, bool device) : device_(device) {
    if (!device) {
      pinned_ = std::make_unique<PinnedBuffer>(bytes);
      return;
    }
    MOELINK_CUDA_CHECK(cudaMalloc(&memory_, static_cast<size_t>(bytes)));
    MOELINK_CUDA_CHECK(cudaMemset(memory_, 0, static_cast<size_t>(bytes)));
    MOELINK_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~FabricBuffer() {
    if (memory_) release_device_memory(memory_);
  }
  FabricBuffer(const FabricBuffer&) = delete;
  FabricBuffer& operator=(const FabricBuffer&) = delete;
  void* engine_ptr() const { return device_ ? memory_ : pinned_->host(); }
  char* kernel_ptr() const { return device_ ? static_cast<char*>(memory_) : pinned_->device(); }
  fabric::MemoryKind kind() const {
    return device_ ? fabric::MemoryKind::kCuda : fabric::MemoryKind::kHost;
  }

 private:
  bool device_;
  std::unique_ptr<PinnedBuffer> pinned_;
  void* memory_ = nullptr;
};

class InternodeGpu final : public AllToAllImpl {
 public:
  InternodeGpu(const Config& c, const ResolvedOptions& o, Bootstrap& bootstrap)
      : AllToAllImpl(c, o),
        layout_(make_layout(geometry_, o.max_private_tokens, o.node_size)),
        plan_view_{c.world_size, c.dp_size} {
    if (c.world_size > kMaxGpuWorldSize)
      throw InvalidArgument("moelink: internode: world_size = " + std::to_string(c.world_size) +
                            " exceeds this backend's limit of " + std::to_string(kMaxGpuWorldSize));
    MOELINK_CUDA_CHECK(cudaGetDevice(&device_));
    MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
    CUdevice dev;
    check_driver(driver().device_get(&dev, device_), "cuDeviceGet");
    int mem_ops = 0;
    check_driver(
        driver().device_attribute(&mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev),
        "cuDeviceGetAttribute");
    if (!mem_ops)
      throw InvalidArgument(
          "moelink: internode: GPU " + std::to_string(device_) +
          " lacks 64-bit stream memory operations (cuStreamWaitValue64), which the backend "
          "needs to wait for the proxy without holding an SM");
    signals_ = std::make_unique<PinnedBuffer>(sizeof(ProxySignals));
    own_header_ = std::make_unique<PinnedBuffer>(layout_.header_bytes);
    allocate_output();
    proxy_ = std::make_unique<Proxy>(geometry_, layout_, o, signals_->host<ProxySignals>(),
                                     ProxyOutput{output_host_, gdr_ != nullptr},
                                     // A dedicated core: spin long before yielding.
                                     /*spin_polls=*/1 << 20);
    const bool direct = use_gpu_direct();
    send_ = std::make_unique<FabricBuffer>(layout_.send_bytes, direct);
    recv_ = std::make_unique<FabricBuffer>(layout_.recv_bytes, direct);
    // Zeroed and mapped by every node peer before any proxy starts (the
    // proxy's constructor ends with a barrier too).
    local_ = std::make_unique<PeerMemory>(static_cast<size_t>(layout_.local_bytes), bootstrap,
                                          o.node_size);
    allocate_state();
    if (options_.profile)
      for (auto& e : events_) MOELINK_CUDA_CHECK(cudaEventCreate(&e));
    Proxy::Buffers b;
    b.send = send_->engine_ptr();
    b.recv = recv_->engine_ptr();
    b.kind = send_->kind();
    b.device = device_;
    b.own_header = own_header_->host();
    if (direct) {
      MOELINK_CUDA_CHECK(cudaStreamCreateWithFlags(&proxy_stream_, cudaStreamNonBlocking));
      b.read_recv = [this](char* dst, int64_t offset, int64_t stride, int64_t bytes, int rows) {
        read_device_recv(dst, offset, stride, bytes, rows);
      };
    }
    proxy_->start(b, bootstrap);
  }

  ~InternodeGpu() override {
    // Work already queued may still wait for proxy steps: let it drain while
    // the proxy runs. Errors here cannot be reported any more. Relaxed: the
    // object may go while another stream of the process captures a graph.
    RelaxedCaptureMode relaxed;
    cudaDeviceSynchronize();
    proxy_.reset();
    for (auto e : events_)
      if (e) cudaEventDestroy(e);
    release_device_memory(private_);
    release_device_memory(local_bases_);
    if (proxy_stream_) cudaStreamDestroy(proxy_stream_);
  }

  Backend backend() const override { return Backend::kInternode; }
  size_t buffer_bytes() const override {
    return static_cast<size_t>(layout_.send_bytes + layout_.recv_bytes + layout_.local_bytes);
  }

  void dispatch(const DispatchArgs& a, bool send, bool recv) override {
    if (send) {
      const GpuDispatchParams p = dispatch_params(a);
      mark(kDispatchPack, a.stream);
      MOELINK_CUDA_CHECK(launch_dispatch_pack(p, blocks(), a.stream));  // raises `request`
      mark(kDispatchPack + 1, a.stream);
    }
    if (recv) {
      await_proxy(a.stream, output_device().dispatch_ready());
      mark(kDispatchUnpack, a.stream);
      MOELINK_CUDA_CHECK(launch_dispatch_unpack(dispatch_params(a), blocks(), a.stream));
      mark(kDispatchUnpack + 1, a.stream);
    }
    last_stream_ = a.stream;
  }

  void combine(const CombineArgs& a, bool send, bool recv) override {
    const GpuCombineParams p = combine_params(a);
    if (send) {
      mark(kCombinePack, a.stream);
      MOELINK_CUDA_CHECK(launch_combine_pack(p, blocks(), a.stream));  // raises `request`
      mark(kCombinePack + 1, a.stream);
    }
    if (recv) {
      await_proxy(a.stream, output_device().combine_ready());
      mark(kCombineUnpack, a.stream);
      MOELINK_CUDA_CHECK(launch_combine_unpack(p, blocks(), a.stream));
      mark(kCombineUnpack + 1, a.stream);
    }
    last_stream_ = a.stream;
  }

  ErrorRecord wait_and_take_error() override {
    MOELINK_CUDA_CHECK(cudaStreamSynchronize(last_stream_));
    if (proxy_->failed()) {
      detail_ = proxy_->error_detail();
      return proxy_->error();
    }
    detail_.clear();
    return take_device_error(last_stream_, state_.error);
  }
  std::string error_detail() const override { return detail_; }

  CallTimes phase_times() override {
    if (!options_.profile) return {};
    MOELINK_CUDA_CHECK(cudaStreamSynchronize(last_stream_));
    CallTimes t;
    t.dispatch = proxy_->dispatch_times();
    t.combine = proxy_->combine_times();
    t.dispatch.pack_us = elapsed_us(kDispatchPack);
    t.dispatch.unpack_us = elapsed_us(kDispatchUnpack);
    t.combine.pack_us = elapsed_us(kCombinePack);
    t.combine.unpack_us = elapsed_us(kCombineUnpack);
    return t;
  }

 private:
  // Event pairs (begin, end) around the kernels of each half.
  enum { kDispatchPack = 0, kDispatchUnpack = 2, kCombinePack = 4, kCombineUnpack = 6 };

  // Profiling events stay out of graphs (their times would belong to no
  // particular replay).
  void mark(int i, cudaStream_t s) {
    if (!options_.profile) return;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    MOELINK_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
    if (status == cudaStreamCaptureStatusNone) MOELINK_CUDA_CHECK(cudaEventRecord(events_[i], s));
  }
  // 0 for a pair not recorded yet.
  double elapsed_us(int i) const {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, events_[i], events_[i + 1]) != cudaSuccess) return 0;
    return 1000.0 * ms;
  }

  // The proxy's output block: device memory behind a GDRCopy mapping when
  // there is one (the stream waits and the unpack kernels then read HBM),
  // else pinned host memory.
  void allocate_output() {
    const auto bytes = static_cast<size_t>(ProxyOutput::bytes(plan_view_));
    std::string why = "MOELINK_GDRCOPY=0";
    const char* env = std::getenv("MOELINK_GDRCOPY");
    if (env == nullptr || std::string(env) != "0") gdr_ = GdrMemory::create(bytes, &why);
    if (gdr_) {
      output_host_ = gdr_->host();
      output_device_ = gdr_->device();
    } else {
      output_pinned_ = std::make_unique<PinnedBuffer>(static_cast<int64_t>(bytes));
      output_host_ = output_pinned_->host();
      output_device_ = output_pinned_->device();
    }
    if (options_.debug)
      std::fprintf(stderr, "moelink: internode rank %d: proxy output in %s\n", config_.rank,
                   gdr_ ? "device memory (GDRCopy)"
                        : ("pinned host memory (no GDRCopy: " + why + ")").c_str());
  }
  ProxyOutput output_device() const { return ProxyOutput{output_device_}; }

  // Options.gpu_direct: 1 needs a provider that accepted FI_HMEM; the
  // default takes it where GPUDirect RDMA is the point of the provider
  // (efa, verbs). shm and tcp stay on host staging (an shm built without
  // CUDA support may still announce FI_HMEM).
  bool use_gpu_direct() const {
    const std::string& p = proxy_->provider();
    const bool hmem = proxy_->engine_hmem();
    if (options_.gpu_direct == 1 && !hmem)
      throw InvalidArgument("moelink: Options.gpu_direct = 1 (GPU buffers registered with the NIC), "
                            "but the libfabric provider '" +
                            p + "' did not accept FI_HMEM; use 0 (host staging)");
    if (options_.gpu_direct >= 0) return options_.gpu_direct == 1;
    return hmem && (p.rfind("efa", 0) == 0 || p.find("verbs") != std::string::npos);
  }

  // The proxy thread reads the peers' routing headers out of device memory:
  // on its own non-blocking stream, so it never waits behind the user's
  // streams (one of which may be waiting for this very step).
  void read_device_recv(char* dst, int64_t offset, int64_t stride, int64_t bytes, int rows) {
    MOELINK_CUDA_CHECK(cudaSetDevice(device_));
    MOELINK_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(bytes),
                                         recv_->kernel_ptr() + offset, static_cast<size_t>(stride),
                                         static_cast<size_t>(bytes), static_cast<size_t>(rows),
                                         cudaMemcpyDeviceToHost, proxy_stream_));
    MOELINK_CUDA_CHECK(cudaStreamSynchronize(proxy_stream_));
  }

  void allocate_state() {
    const Geometry& g = geometry_;
    const int64_t T = g.max_num_tokens, W = g.world_size, k = g.experts_per_token;
    const int64_t slots = static_cast<int64_t>(g.num_dp_groups) * T;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off = align_up(off + bytes, 256);
      return at;
    };
    const int64_t dest_off = take(4 * T * W);
    const int64_t counts_off = take(4 * g.dp_size * W);
    const int64_t counter_off = take(4 * int64_t{g.num_local_experts});
    const int64_t n_off = take(4 * slots);
    const int64_t routes_off = take(static_cast<int64_t>(sizeof(RouteEntry)) * slots * k);
    const int64_t rows_off = take(4 * slots * k);
    const int64_t sender_off = take(4 * slots);
    const int64_t m_off = take(4);
    const int64_t epoch_off = take(4);
    const int64_t error_off = take(sizeof(ErrorRecord));
    void* mem = nullptr;
    MOELINK_CUDA_CHECK(cudaMalloc(&mem, off));
    MOELINK_CUDA_CHECK(cudaMemset(mem, 0, off));
    private_ = static_cast<char*>(mem);
    state_.dest_index = reinterpret_cast<int32_t*>(private_ + dest_off);
    state_.counts = reinterpret_cast<uint32_t*>(private_ + counts_off);
    state_.expert_counter = reinterpret_cast<int32_t*>(private_ + counter_off);
    state_.recv_routes_n = reinterpret_cast<int32_t*>(private_ + n_off);
    state_.recv_routes = reinterpret_cast<RouteEntry*>(private_ + routes_off);
    state_.recv_rows = reinterpret_cast<int32_t*>(private_ + rows_off);
    state_.recv_sender = reinterpret_cast<int32_t*>(private_ + sender_off);
    state_.dispatch_m = reinterpret_cast<int32_t*>(private_ + m_off);
    state_.epoch = reinterpret_cast<uint32_t*>(private_ + epoch_off);
    state_.error = reinterpret_cast<ErrorRecord*>(private_ + error_off);
    // The node peers' local areas as this process maps them, for the kernels.
    const int n = layout_.node_size, first = g.rank / n * n;
    std::vector<char*> bases(local_->bases().begin() + first, local_->bases().begin() + first + n);
    MOELINK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&local_bases_), sizeof(char*) * n));
    MOELINK_CUDA_CHECK(
        cudaMemcpy(local_bases_, bases.data(), sizeof(char*) * n, cudaMemcpyHostToDevice));
  }

  // A decode-sized grid whatever the buffers: these kernels only pack and
  // unpack through pinned host memory (a larger grid for prefill has not
  // been measured here).
  int blocks() const {
    return options_.num_blocks > 0 ? std::min(options_.num_blocks, num_sms_)
                                   : std::min(num_sms_, kDecodeBlocks);
  }

  // The stream waits until the proxy set `ready` to 1 and sets it back to
  // 0: constants only, so a captured graph replays the same handshake
  // (the step number lives in device memory, see request_kernel). No SM is
  // held while it waits.
  static void await_proxy(cudaStream_t s, uint64_t* ready) {
    const auto stream = reinterpret_cast<CUstream>(s);
    const auto word = reinterpret_cast<CUdeviceptr>(ready);
    check_driver(driver().wait_value64(stream, word, 1, CU_STREAM_WAIT_VALUE_EQ),
                 "cuStreamWaitValue64");
    check_driver(driver().write_value64(stream, word, 0, CU_STREAM_WRITE_VALUE_DEFAULT),
                 "cuStreamWriteValue64");
  }

  GpuCommon common() const {
    GpuCommon c{};
    c.geo = geometry_;
    c.layout = layout_;
    c.plan_view = plan_view_;
    c.send = send_->kernel_ptr();
    c.recv = recv_->kernel_ptr();
    c.own_header = own_header_->device();
    c.plan = output_device().plan();
    c.local = local_->local();
    c.local_bases = local_bases_;
    c.state = state_;
    c.request = &signals_->device<ProxySignals>()->request;
    return c;
  }

  GpuDispatchParams dispatch_params(const DispatchArgs& a) const {
    GpuDispatchParams p{};
    static_cast<DispatchTensors&>(p) = dispatch_tensors(a);
    p.c = common();
    return p;
  }

  GpuCombineParams combine_params(const CombineArgs& a) const {
    GpuCombineParams p{};
    static_cast<CombineTensors&>(p) = combine_tensors(a);
    p.c = common();
    return p;
  }

  Layout layout_;
  PlanView plan_view_;
  int device_ = 0;
  int num_sms_ = 0;
  std::unique_ptr<FabricBuffer> send_, recv_;
  std::unique_ptr<PinnedBuffer> signals_, own_header_;
  cudaStream_t proxy_stream_ = nullptr;  // GPUDirect: the proxy's header reads
  // The proxy's output block (ProxyOutput), in one of the two.
  std::unique_ptr<GdrMemory> gdr_;
  std::unique_ptr<PinnedBuffer> output_pinned_;
  char* output_host_ = nullptr;
  char* output_device_ = nullptr;
  std::unique_ptr<PeerMemory> local_;  // this rank's local area, node peers' mapped
  char** local_bases_ = nullptr;       // [node_size] device copy of those addresses
  char* private_ = nullptr;
  GpuState state_{};
  std::unique_ptr<Proxy> proxy_;
  cudaStream_t last_stream_ = nullptr;
  std::string detail_;
  cudaEvent_t events_[8] = {};
};

}  // namespace

std::unique_ptr<AllToAllImpl> make_internode_gpu_impl(const Config& c, const ResolvedOptions& o,
                                                      Bootstrap& bootstrap) {
  return std::make_unique<InternodeGpu>(c, o, bootstrap);
}

}  // namespace moelink::detail::internode
