// Host side of the NVLink backend: owns the peer-mapped buffer and the
// private device state, turns call arguments into kernel parameters and
// launches the four kernels. No host synchronization on the data path.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/all_to_all_impl.h"
#include "core/kernel_blocks.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"
#include "nvlink/kernels.h"
#include "nvlink/peer_memory.h"

namespace moelink::detail {
namespace {

class NvlinkAllToAll final : public AllToAllImpl {
 public:
  NvlinkAllToAll(const Config& c, const ResolvedOptions& o, Bootstrap& bootstrap)
      : AllToAllImpl(c, o) {
    if (c.world_size > kMaxNvlinkWorldSize)
      throw InvalidArgument("moelink: world_size = " + std::to_string(c.world_size) +
                            " exceeds the NVLink backend's limit of " +
                            std::to_string(kMaxNvlinkWorldSize));
    MOELINK_CUDA_CHECK(cudaGetDevice(&device_));
    MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
    // Receivers count the senders' blocks: every rank must launch alike.
    const int mine = blocks();
    std::vector<int> all(c.world_size);
    bootstrap.all_gather(&mine, all.data(), sizeof(int));
    for (int r = 0; r < c.world_size; ++r)
      if (all[r] != mine)
        throw InvalidArgument("moelink: Options.num_blocks resolves to " + std::to_string(all[r]) +
                              " blocks on rank " + std::to_string(r) + " but " +
                              std::to_string(mine) + " on rank " + std::to_string(c.rank) +
                              "; every rank must use the same value (and GPUs with the same "
                              "SM count)");
    memory_ = std::make_unique<PeerMemory>(geometry_.total_bytes, bootstrap);
    allocate_private_state();
  }

  ~NvlinkAllToAll() override { release_device_memory(private_); }

  Backend backend() const override { return Backend::kNVLink; }
  size_t buffer_bytes() const override { return memory_->bytes(); }

  void dispatch(const DispatchArgs& a, bool send, bool recv) override {
    launch_dispatch(dispatch_params(a), send, recv, blocks(), a.stream);
    after_launch("dispatch", a.stream);
  }
  void combine(const CombineArgs& a, bool send, bool recv) override {
    launch_combine(combine_params(a), send, recv, blocks(), a.stream);
    after_launch("combine", a.stream);
  }

  ErrorRecord wait_and_take_error() override {
    return take_device_error(last_stream_, common_.error);
  }

 private:
  void allocate_private_state() {
    const Geometry& g = geometry_;
    const int64_t slots = static_cast<int64_t>(g.num_dp_groups) * g.max_num_tokens;
    // One allocation, carved into 256-byte aligned pieces.
    const int64_t state_off = 0;
    const int64_t error_off = align_up(state_off + sizeof(DeviceState), 256);
    const int64_t rows_off = align_up(error_off + sizeof(ErrorRecord), 256);
    const int64_t slots_off = align_up(rows_off + 4 * slots * g.experts_per_token, 256);
    const int64_t total = align_up(slots_off + 4 * slots, 256);
    void* mem = nullptr;
    MOELINK_CUDA_CHECK(cudaMalloc(&mem, total));
    private_ = static_cast<char*>(mem);
    MOELINK_CUDA_CHECK(cudaMemset(private_, 0, total));
    common_.geo = g;
    for (int r = 0; r < g.world_size; ++r) common_.peers[r] = memory_->bases()[r];
    common_.local = memory_->local();
    common_.state = reinterpret_cast<DeviceState*>(private_ + state_off);
    common_.error = reinterpret_cast<ErrorRecord*>(private_ + error_off);
    common_.route_rows = reinterpret_cast<int32_t*>(private_ + rows_off);
    common_.valid_slots = reinterpret_cast<int32_t*>(private_ + slots_off);
    common_.timeout_ns = static_cast<uint64_t>(options_.timeout_s * 1e9);
  }

  // Blocks per kernel: a small, fixed number of SMs so the kernels can run
  // beside compute; Options.num_blocks overrides.
  int blocks() const { return kernel_blocks(options_, config_, num_sms_); }

  DispatchParams dispatch_params(const DispatchArgs& a) const {
    DispatchParams p{};
    static_cast<DispatchTensors&>(p) = dispatch_tensors(a);
    p.c = common_;
    // Prefill-sized fused dispatches overlap sending and receiving: half the
    // blocks receive (HBM-bound fan-out) while half send (NVLink-bound).
    p.recv_blocks = prefill_sized(config_) ? blocks() / 2 : 0;
    return p;
  }

  CombineParams combine_params(const CombineArgs& a) const {
    CombineParams p{};
    static_cast<CombineTensors&>(p) = combine_tensors(a);
    p.c = common_;
    return p;
  }

  void after_launch(const char* what, cudaStream_t stream) {
    last_stream_ = stream;
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, what, __FILE__, __LINE__);
  }

  int device_ = 0;
  int num_sms_ = 0;
  std::unique_ptr<PeerMemory> memory_;
  char* private_ = nullptr;
  CommonParams common_{};
  cudaStream_t last_stream_ = nullptr;
};

}  // namespace

std::unique_ptr<AllToAllImpl> make_nvlink_impl(const Config& c, const ResolvedOptions& o,
                                               Bootstrap& bootstrap) {
  return std::make_unique<NvlinkAllToAll>(c, o, bootstrap);
}

}  // namespace moelink::detail
