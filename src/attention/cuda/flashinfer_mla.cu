// FlashInferMLA on FlashInfer's headers (flashinfer_mla.h).
#include <flashinfer/attention/mla_hopper.cuh>
#include <flashinfer/attention/scheduler.cuh>

#include <map>
#include <string>
#include <vector>

#include "attention/cuda/flashinfer_mla.h"
#include "moelink/errors.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail::attention {

namespace {

using Params = flashinfer::MLAParams<nv_bfloat16, nv_bfloat16, nv_bfloat16, int32_t>;

template <class T>
T* at(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

class FlashInferMLAImpl final : public FlashInferMLA {
 public:
  explicit FlashInferMLAImpl(int heads) : heads_(heads) {
    int device = 0, sms = 0;
    MOELINK_CUDA_CHECK(cudaGetDevice(&device));
    MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    // MLAPlan's own sizes: partial outputs of two 64-row tiles per SM
    // (bf16, 512 wide) and their LSE; 12 int arrays of its 16384 works.
    float_bytes_ = size_t{2} * sms * 128 * (2 * kLatent + 4) + (1 << 20);
    int_bytes_ = size_t{4} << 20;
    MOELINK_CUDA_CHECK(cudaMalloc(&float_ws_, float_bytes_));
    MOELINK_CUDA_CHECK(cudaMalloc(&int_ws_, int_bytes_));
    MOELINK_CUDA_CHECK(cudaMallocHost(&staging_, int_bytes_));
    MOELINK_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
  }
  ~FlashInferMLAImpl() override {
    RelaxedCaptureMode relaxed;
    cudaEventDestroy(staged_);
    cudaFreeHost(staging_);
    release_device_memory(int_ws_);
    release_device_memory(float_ws_);
  }

  void plan(const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_len, int batch,
            cudaStream_t stream) override {
    const uint64_t capture = capture_id(stream);
    // The layers of a model step plan the same batch one after another:
    // the schedule already on its way into the workspace serves them all.
    const PlanInputs inputs(q_indptr, kv_indptr, kv_len, batch, capture, stream);
    if (planned_valid_ && planned_ == inputs) return;
    // The staging buffer may still feed the previous plan's copy (not
    // while capturing: nothing runs then, and the capture may not wait).
    if (capture == 0) MOELINK_CUDA_CHECK(cudaEventSynchronize(staged_));
    const size_t staged_bytes = schedule(q_indptr, kv_indptr, kv_len, batch, info_);
    MOELINK_CUDA_CHECK(cudaMemcpyAsync(int_ws_, staging_, staged_bytes, cudaMemcpyHostToDevice, stream));
    if (capture != 0) {
      captured_[batch] = {info_, staged_bytes, capture};
    } else {
      MOELINK_CUDA_CHECK(cudaEventRecord(staged_, stream));
    }
    planned_ = inputs;
    planned_valid_ = true;
    replanned_valid_ = false;  // staging now holds this plan
  }

  void replan(const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_len, int batch) override {
    const auto it = captured_.find(batch);
    if (it == captured_.end())
      throw InvalidArgument("moelink: FlashInfer MLA: replan of a batch of " + std::to_string(batch) +
                            " requests without a captured plan of that size");
    const Captured& c = it->second;
    // The replay's copy will overwrite the workspace: no eager plan is there.
    planned_valid_ = false;
    const PlanInputs inputs(q_indptr, kv_indptr, kv_len, batch, 0, nullptr);
    if (replanned_valid_ && replanned_ == inputs) return;  // another layer of the same replay
    MOELINK_CUDA_CHECK(cudaEventSynchronize(staged_));  // an eager plan's copy may still read staging
    replanned_valid_ = false;
    flashinfer::MLAPlanInfo info{};
    const size_t staged_bytes = schedule(q_indptr, kv_indptr, kv_len, batch, info);
    if (info.ToVector() != c.info.ToVector() || staged_bytes != c.bytes)
      throw InvalidArgument("moelink: MLAAttention.prepare_graph_replay: this batch's FlashInfer schedule (" +
                            std::to_string(info.num_blks_x) + " x " + std::to_string(info.num_blks_y) +
                            " blocks) does not fit the captured one (" + std::to_string(c.info.num_blks_x) +
                            " x " + std::to_string(c.info.num_blks_y) + "): capture the step again");
    replanned_ = inputs;
    replanned_valid_ = true;
  }

  bool captured(int batch) const override { return captured_.count(batch) != 0; }
  void forget_capture(int batch, cudaStream_t stream) override {
    const auto it = captured_.find(batch);
    // Not the plan an earlier layer of this same capture made.
    if (it != captured_.end() && it->second.capture != capture_id(stream)) captured_.erase(it);
  }

  // The id of the capture under way on `stream`; 0 when none is.
  static uint64_t capture_id(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    MOELINK_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
    return status == cudaStreamCaptureStatusNone ? 0 : static_cast<uint64_t>(id);
  }

  // MLAPlan: the schedule into the host staging buffer and `info`; the
  // bytes to copy to the device.
  size_t schedule(const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_len, int batch,
                  flashinfer::MLAPlanInfo& info) {
    size_t staged_bytes = 0;
    const cudaError_t e = flashinfer::MLAPlan<int32_t>(
        float_ws_, float_bytes_, int_ws_, staging_, int_bytes_, info, staged_bytes,
        const_cast<int32_t*>(q_indptr), const_cast<int32_t*>(kv_indptr), const_cast<int32_t*>(kv_len),
        static_cast<uint32_t>(batch), static_cast<uint32_t>(heads_), kLatent, /*causal=*/true, nullptr);
    if (e != cudaSuccess) throw_cuda_error(e, "flashinfer::MLAPlan", __FILE__, __LINE__);
    return staged_bytes;
  }

  void run(const FlashInferMLAArgs& a, cudaStream_t stream) override {
    Params p{};
    p.q_nope = const_cast<nv_bfloat16*>(reinterpret_cast<const nv_bfloat16*>(a.q_latent));
    p.q_pe = const_cast<nv_bfloat16*>(reinterpret_cast<const nv_bfloat16*>(a.q_pe));
    auto* cache = const_cast<nv_bfloat16*>(reinterpret_cast<const nv_bfloat16*>(a.cache));
    p.ckv = cache;
    p.kpe = cache + kLatent;
    p.final_o = reinterpret_cast<nv_bfloat16*>(a.out);
    p.final_lse = nullptr;
    p.partial_o = at<nv_bfloat16>(float_ws_, info_.partial_o_offset);
    p.partial_lse = at<float>(float_ws_, info_.partial_lse_offset);
    p.q_indptr = at<int32_t>(int_ws_, info_.q_indptr_offset);
    p.kv_indptr = at<int32_t>(int_ws_, info_.kv_indptr_offset);
    p.partial_indptr = at<int32_t>(int_ws_, info_.partial_indptr_offset);
    p.merge_packed_offset_start = at<int32_t>(int_ws_, info_.merge_packed_offset_start_offset);
    p.merge_packed_offset_end = at<int32_t>(int_ws_, info_.merge_packed_offset_end_offset);
    p.merge_partial_packed_offset_start = at<int32_t>(int_ws_, info_.merge_partial_packed_offset_start_offset);
    p.merge_partial_packed_offset_end = at<int32_t>(int_ws_, info_.merge_partial_packed_offset_end_offset);
    p.merge_partial_stride = at<int32_t>(int_ws_, info_.merge_partial_stride_offset);
    p.kv_indices = const_cast<int32_t*>(a.block_table);
    p.q_len = at<int32_t>(int_ws_, info_.q_len_offset);
    p.kv_len = at<int32_t>(int_ws_, info_.kv_len_offset);
    p.q_start = at<int32_t>(int_ws_, info_.q_start_offset);
    p.kv_start = at<int32_t>(int_ws_, info_.kv_start_offset);
    p.kv_end = at<int32_t>(int_ws_, info_.kv_end_offset);
    p.work_indptr = at<int32_t>(int_ws_, info_.work_indptr_offset);
    p.num_heads = flashinfer::uint_fastdiv(static_cast<uint32_t>(heads_));
    p.block_size = flashinfer::uint_fastdiv(static_cast<uint32_t>(a.page_size));
    p.q_nope_stride_n = static_cast<uint32_t>(a.q_latent_stride_row);
    p.q_nope_stride_h = static_cast<uint32_t>(a.q_latent_stride_head);
    p.q_pe_stride_n = static_cast<uint32_t>(a.q_pe_stride_row);
    p.q_pe_stride_h = static_cast<uint32_t>(a.q_pe_stride_head);
    p.ckv_stride_page = p.kpe_stride_page = static_cast<uint32_t>(a.page_size * (kLatent + kRope));
    p.ckv_stride_n = p.kpe_stride_n = kLatent + kRope;
    p.o_stride_n = static_cast<uint32_t>(a.out_stride_row);
    p.o_stride_h = static_cast<uint32_t>(a.out_stride_head);
    p.sm_scale = a.scale;
    p.ckv_scale = p.kpe_scale = 1.0f;
    p.ckv_scale_arr = nullptr;
    p.return_lse_base_on_e = false;
    const cudaError_t e = flashinfer::mla::BatchMLAPageAttentionHopper<flashinfer::MaskMode::kCausal, kLatent, kRope>(
        p, static_cast<uint32_t>(info_.num_blks_x), static_cast<uint32_t>(info_.num_blks_y), stream);
    if (e != cudaSuccess) throw_cuda_error(e, "flashinfer::mla::BatchMLAPageAttentionHopper", __FILE__, __LINE__);
  }

 private:
  int heads_;
  size_t float_bytes_ = 0, int_bytes_ = 0;
  void* float_ws_ = nullptr;
  void* int_ws_ = nullptr;
  void* staging_ = nullptr;
  cudaEvent_t staged_ = nullptr;
  flashinfer::MLAPlanInfo info_{};
  // A plan's inputs: the batch, and where its copy was enqueued (the
  // stream and the capture, 0 for none).
  struct PlanInputs {
    PlanInputs() = default;
    PlanInputs(const int32_t* q, const int32_t* kv, const int32_t* len, int b, uint64_t c, cudaStream_t s)
        : q_indptr(q, q + b + 1), kv_indptr(kv, kv + b), kv_len(len, len + b), batch(b), capture(c), stream(s) {}
    bool operator==(const PlanInputs& o) const {
      return batch == o.batch && capture == o.capture && stream == o.stream && q_indptr == o.q_indptr &&
             kv_indptr == o.kv_indptr && kv_len == o.kv_len;
    }
    std::vector<int32_t> q_indptr, kv_indptr, kv_len;
    int batch = 0;
    uint64_t capture = 0;
    cudaStream_t stream = nullptr;
  };
  // What the workspace holds once the stream reaches the last plan's copy
  // (invalid after a replan: the replay copies its own), and what the
  // staging buffer holds for the next replay.
  PlanInputs planned_, replanned_;
  bool planned_valid_ = false, replanned_valid_ = false;
  // The plan each batch size's graph captured (its grid and layout, which
  // the graph's kernel launch keeps): a replay's schedule must match it.
  struct Captured {
    flashinfer::MLAPlanInfo info;
    size_t bytes;
    uint64_t capture;  // cudaStreamGetCaptureInfo's id
  };
  std::map<int, Captured> captured_;
};

}  // namespace

bool FlashInferMLA::built() { return true; }

std::unique_ptr<FlashInferMLA> FlashInferMLA::create(int heads) {
  return std::make_unique<FlashInferMLAImpl>(heads);
}

}  // namespace moelink::detail::attention
