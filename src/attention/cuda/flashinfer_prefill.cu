// FlashInferPrefill on FlashInfer's headers (flashinfer_prefill.h).
#include <flashinfer/attention/hopper/default_params.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>

#include "attention/cuda/flashinfer_prefill.h"
#include "moelink/errors.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::attention {

namespace {

using Params = flashinfer::SinglePrefillParams<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::bfloat16_t>;

template <flashinfer::MaskMode kMask>
cudaError_t launch(Params& p, cudaStream_t stream) {
  using flashinfer::StandardAttention;
  return flashinfer::SinglePrefillWithKVCacheDispatched<FlashInferPrefill::kQkDims, FlashInferPrefill::kVDims,
                                                        kMask, /*LEFT_SLIDING_WINDOW=*/false, StandardAttention>(
      p, stream);
}

class FlashInferPrefillImpl final : public FlashInferPrefill {
 public:
  void run(const FlashInferPrefillArgs& a, cudaStream_t stream) override {
    if (a.q_rows == 0 || a.keys == 0) return;
    if (a.causal && a.q_rows != a.keys)
      throw InvalidArgument("moelink: FlashInfer prefill: a causal range needs as many query rows as keys");
    Params p{};
    auto bf16 = [](const uint16_t* x) { return reinterpret_cast<cutlass::bfloat16_t*>(const_cast<uint16_t*>(x)); };
    p.q_ptr = bf16(a.q);
    p.k_ptr = bf16(a.k);
    p.v_ptr = bf16(a.v);
    p.o_ptr = bf16(a.out);
    p.lse_ptr = a.lse;
    p.additional_params.logits_soft_cap = 0.0f;
    p.additional_params.sm_scale = a.scale;
    p.additional_params.scale_q = p.additional_params.scale_k = p.additional_params.scale_v = nullptr;
    p.q_stride_n = a.q_stride_row;
    p.q_stride_h = a.q_stride_head;
    p.k_stride_n = a.k_stride_row;
    p.k_stride_h = a.k_stride_head;
    p.v_stride_n = a.v_stride_row;
    p.v_stride_h = a.v_stride_head;
    p.o_stride_n = a.out_stride_row;
    p.o_stride_h = a.out_stride_head;
    p.qo_len = a.q_rows;
    p.kv_len = a.keys;
    p.num_qo_heads = p.num_kv_heads = a.heads;
    p.group_size = 1;
    p.window_left = -1;
    p.causal = a.causal;
    const cudaError_t e = a.causal ? launch<flashinfer::MaskMode::kCausal>(p, stream)
                                   : launch<flashinfer::MaskMode::kNone>(p, stream);
    if (e != cudaSuccess) throw_cuda_error(e, "flashinfer::SinglePrefillWithKVCacheDispatched", __FILE__, __LINE__);
  }
};

}  // namespace

bool FlashInferPrefill::built() { return true; }

std::unique_ptr<FlashInferPrefill> FlashInferPrefill::create() { return std::make_unique<FlashInferPrefillImpl>(); }

}  // namespace moelink::detail::attention
