// Host side of the NVSHMEM backend: takes a symmetric buffer from the
// process-wide runtime, owns the private device state, turns call arguments
// into kernel parameters and launches the kernels. No host synchronization
// on the data path; nothing collective on destruction.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>

#include "core/all_to_all_impl.h"
#include "core/kernel_blocks.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"
#include "nvshmem/kernels.h"
#include "nvshmem/runtime.h"

namespace moelink::detail {
namespace {

using shmem::CombineItem;
using shmem::ShmemState;


class NvshmemAllToAll final : public AllToAllImpl {
 public:
  NvshmemAllToAll(const Config& c, const ResolvedOptions& o, Bootstrap& bootstrap)
      : AllToAllImpl(c, o) {
    int device = 0;
    MOELINK_CUDA_CHECK(cudaGetDevice(&device));
    MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device));
    shmem::ensure_initialized(bootstrap);
    layout_ = shmem::make_shmem_layout(geometry_);
    allocate_private_state();
    // Collective; every rank has zeroed its buffer when it returns.
    sym_ = shmem::symmetric_acquire(static_cast<size_t>(layout_.total_bytes), bootstrap);
    common_.sym = sym_;
  }

  ~NvshmemAllToAll() override {
    // The kernels that use the buffer must be done before another AllToAll
    // of this process may take it from the pool. Relaxed: the object may go
    // while another stream of the process captures a graph.
    RelaxedCaptureMode relaxed;
    cudaDeviceSynchronize();
    release_device_memory(private_);
    if (sym_ != nullptr) shmem::symmetric_release(sym_);
  }

  Backend backend() const override { return Backend::kNVSHMEM; }
  size_t buffer_bytes() const override { return static_cast<size_t>(layout_.total_bytes); }

  void dispatch(const DispatchArgs& a, bool send, bool recv) override {
    shmem::launch_dispatch(dispatch_params(a), send, recv, blocks(), a.stream);
    after_launch("dispatch", a.stream);
  }
  void combine(const CombineArgs& a, bool send, bool recv) override {
    shmem::launch_combine(combine_params(a), send, recv, blocks(), a.stream);
    after_launch("combine", a.stream);
  }

  ErrorRecord wait_and_take_error() override {
    return take_device_error(last_stream_, common_.error);
  }

 private:
  void allocate_private_state() {
    const Geometry& g = geometry_;
    // One allocation, carved into 256-byte aligned pieces.
    const int64_t state_off = 0;
    const int64_t error_off = align_up(state_off + sizeof(ShmemState), 256);
    const int64_t pos_off = align_up(error_off + sizeof(ErrorRecord), 256);
    const int64_t items_off = align_up(pos_off + 4 * static_cast<int64_t>(g.num_experts), 256);
    const int64_t total = align_up(items_off + layout_.stage_rows * sizeof(CombineItem), 256);
    void* mem = nullptr;
    MOELINK_CUDA_CHECK(cudaMalloc(&mem, total));
    private_ = static_cast<char*>(mem);
    MOELINK_CUDA_CHECK(cudaMemset(private_, 0, total));
    common_.geo = g;
    common_.lay = layout_;
    common_.state = reinterpret_cast<ShmemState*>(private_ + state_off);
    common_.error = reinterpret_cast<ErrorRecord*>(private_ + error_off);
    common_.positions = reinterpret_cast<int32_t*>(private_ + pos_off);
    common_.items = reinterpret_cast<CombineItem*>(private_ + items_off);
    common_.timeout_ns = static_cast<uint64_t>(options_.timeout_s * 1e9);
  }

  // Unlike NVLink, no receiver counts the senders' blocks, so ranks may
  // differ here.
  int blocks() const { return kernel_blocks(options_, config_, num_sms_); }

  shmem::DispatchParams dispatch_params(const DispatchArgs& a) const {
    shmem::DispatchParams p{};
    static_cast<DispatchTensors&>(p) = dispatch_tensors(a);
    p.c = common_;
    return p;
  }

  shmem::CombineParams combine_params(const CombineArgs& a) const {
    shmem::CombineParams p{};
    static_cast<CombineTensors&>(p) = combine_tensors(a);
    p.c = common_;
    return p;
  }

  void after_launch(const char* what, cudaStream_t stream) {
    last_stream_ = stream;
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, what, __FILE__, __LINE__);
  }

  int num_sms_ = 0;
  shmem::ShmemLayout layout_{};
  char* sym_ = nullptr;
  char* private_ = nullptr;
  shmem::Common common_{};
  cudaStream_t last_stream_ = nullptr;
};

}  // namespace

std::unique_ptr<AllToAllImpl> make_nvshmem_impl(const Config& c, const ResolvedOptions& o,
                                                Bootstrap& bootstrap) {
  return std::make_unique<NvshmemAllToAll>(c, o, bootstrap);
}

}  // namespace moelink::detail
