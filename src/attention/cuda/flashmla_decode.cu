// FlashMLADecode (flashmla_decode.h) on FlashMLA's sources: its launchers
// for the scheduler, the split-KV kernel and the merge, over moelink's rows.
#include <cutlass/bfloat16.h>

#include <algorithm>

#include "attention/cuda/flashmla_decode.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_memory.h"
#include "nvlink/cuda_release.h"
// FlashMLA's (csrc/ and csrc/sm90/ on this file's include path).
#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace moelink::detail::attention {

namespace {

// FlashMLA's query tile (Config::BLOCK_SIZE_M) and the scheduler's cost of
// a split in key blocks (its interface's 5).
constexpr int kQueryTile = 64, kSplitOverheadBlocks = 5;
constexpr int kPrepThreads = 128;

// Row r's key count (its position + 1; 0 for a skipped row or one past the
// decode rows) and its request's block-table row, for FlashMLA's requests
// of one query token each. A row of no keys gets page 0 in its first
// entry: FlashMLA's prologue loads the first page of any request before it
// knows the request is empty.
__global__ void __launch_bounds__(kPrepThreads)
    flashmla_rows_kernel(const int32_t* request, const int32_t* position, const int32_t* decode_rows,
                         const int32_t* block_table, int64_t block_stride, int32_t max_pages, int32_t* seqlens,
                         int32_t* tables) {
  const int r = blockIdx.x;
  const int32_t i = r < *decode_rows ? request[r] : -1;
  const int32_t keys = i >= 0 ? position[r] + 1 : 0;
  if (threadIdx.x == 0) seqlens[r] = keys;
  const int32_t pages = (keys + FlashMLADecode::kPageSize - 1) / FlashMLADecode::kPageSize;
  int32_t* row = tables + static_cast<int64_t>(r) * max_pages;
  for (int32_t p = threadIdx.x; p < max_pages; p += kPrepThreads)
    row[p] = p < pages ? block_table[i * block_stride + p] : 0;
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

class FlashMLADecodeImpl final : public FlashMLADecode {
 public:
  explicit FlashMLADecodeImpl(int heads) : heads_(heads), parts_(sm_parts(heads)) {}

  void run(const FlashMLADecodeArgs& a, cudaStream_t stream) override {
    const size_t rows = static_cast<size_t>(a.rows), splits = rows + parts_;
    // The workspace: row lengths, row tables, the schedule, split offsets,
    // LSE, and the splits' LSE and partial outputs (fp32).
    const size_t o_seqlens = 0, o_tables = align_up(rows * 4),
                 o_meta = o_tables + align_up(rows * a.max_pages * 4),
                 o_splits = o_meta + align_up(parts_ * sizeof(DecodingSchedMeta)),
                 o_lse = o_splits + align_up((rows + 1) * 4), o_lse_acc = o_lse + align_up(rows * heads_ * 4),
                 o_out_acc = o_lse_acc + align_up(splits * heads_ * 4),
                 bytes = o_out_acc + splits * heads_ * kLatent * 4;
    char* ws = nullptr;
    {
      RelaxedCaptureMode relaxed;  // a first use may come inside a capture
      ws = static_cast<char*>(workspace_.get(bytes));
    }
    auto* seqlens = reinterpret_cast<int32_t*>(ws + o_seqlens);
    auto* tables = reinterpret_cast<int32_t*>(ws + o_tables);
    auto* meta = reinterpret_cast<DecodingSchedMeta*>(ws + o_meta);
    auto* num_splits = reinterpret_cast<int32_t*>(ws + o_splits);
    auto* lse = reinterpret_cast<float*>(ws + o_lse);
    auto* lse_acc = reinterpret_cast<float*>(ws + o_lse_acc);
    auto* out_acc = reinterpret_cast<float*>(ws + o_out_acc);

    flashmla_rows_kernel<<<a.rows, kPrepThreads, 0, stream>>>(a.request, a.position, a.decode_rows,
                                                              a.block_table, a.block_stride, a.max_pages,
                                                              seqlens, tables);
    MOELINK_CUDA_CHECK(cudaGetLastError());

    GetDecodeSchedMetaParams sched{};
    sched.b = a.rows;
    sched.s_q = 1;
    sched.block_size_n = kPageSize;
    sched.fixed_overhead_num_blocks = kSplitOverheadBlocks;
    sched.topk = sched.extra_topk = -1;  // dense
    sched.seqlens_k_ptr = seqlens;
    sched.tile_scheduler_metadata_ptr = meta;
    sched.num_splits_ptr = num_splits;
    sched.num_sm_parts = parts_;
    sched.stream = stream;
    smxx::decode::run_get_decoding_sched_meta_kernel(sched);

    // A row is FlashMLA's batch entry of one query token; its heads are
    // that token's query "sequence" (q_seq_per_hk) over the one latent head.
    DenseAttnDecodeParams p{};
    p.b = a.rows;
    p.s_q = 1;
    p.q_seq_per_hk = heads_;
    p.d = kLatent + kRope;
    p.d_v = kLatent;
    p.h_q = heads_;
    p.h_k = 1;
    p.num_blocks = static_cast<int>(a.num_pages);
    p.q_head_per_hk = heads_;
    p.is_causal = false;  // each row's keys end at its own position
    p.scale_softmax = a.scale;
    p.scale_softmax_log2 = a.scale * 1.4426950408889634f;
    p.q_ptr = const_cast<uint16_t*>(a.q);
    p.k_ptr = const_cast<uint16_t*>(a.cache);
    p.o_ptr = a.out;
    p.softmax_lse_ptr = lse;
    p.q_batch_stride = a.q_stride_row;
    p.q_row_stride = a.q_stride_head;
    p.q_head_stride = a.q_stride_head * heads_;  // the one latent head
    p.k_batch_stride = int64_t{kPageSize} * (kLatent + kRope);
    p.k_row_stride = kLatent + kRope;
    p.k_head_stride = kLatent + kRope;
    p.o_batch_stride = a.out_stride_row;
    p.o_row_stride = a.out_stride_head;
    p.o_head_stride = a.out_stride_head * heads_;
    p.block_table = tables;
    p.block_table_batch_stride = a.max_pages;
    p.page_block_size = kPageSize;
    p.seqlens_k_ptr = seqlens;
    p.tile_scheduler_metadata_ptr = meta;
    p.num_sm_parts = parts_;
    p.num_splits_ptr = num_splits;
    p.total_num_splits = static_cast<int>(splits);
    p.softmax_lseaccum_ptr = lse_acc;
    p.oaccum_ptr = out_acc;
    p.stream = stream;
    sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

    // The merge of the rows split over several parts (FlashMLA's layout of
    // the partials: split, head; the output's: row, head by the strides).
    CombineParams m{};
    m.b = a.rows;
    m.s_q = 1;
    m.h_q = heads_;
    m.d_v = kLatent;
    m.lse = lse;
    m.out = a.out;
    m.stride_lse_b = heads_;
    m.stride_lse_s_q = heads_;
    m.stride_o_b = static_cast<int>(a.out_stride_row);
    m.stride_o_s_q = static_cast<int>(a.out_stride_row);
    m.stride_o_h_q = static_cast<int>(a.out_stride_head);
    m.lse_accum = lse_acc;
    m.o_accum = out_acc;
    m.stride_lse_accum_split = heads_;
    m.stride_lse_accum_s_q = heads_;
    m.stride_o_accum_split = heads_ * kLatent;
    m.stride_o_accum_s_q = heads_ * kLatent;
    m.stride_o_accum_h_q = kLatent;
    m.tile_scheduler_metadata_ptr = meta;
    m.num_splits_ptr = num_splits;
    m.num_sm_parts = parts_;
    m.attn_sink = nullptr;
    m.stream = stream;
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(m);
  }

 private:
  const int heads_, parts_;
  GrowingDeviceBuffer workspace_;
};

}  // namespace

bool FlashMLADecode::built() { return true; }

int FlashMLADecode::sm_parts(int heads) {
  int device = 0, sms = 0;
  MOELINK_CUDA_CHECK(cudaGetDevice(&device));
  MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms / ((heads + kQueryTile - 1) / kQueryTile), 1);
}

std::unique_ptr<FlashMLADecode> FlashMLADecode::create(int heads) {
  return std::make_unique<FlashMLADecodeImpl>(heads);
}

}  // namespace moelink::detail::attention
