#include "nvlink/error_record_batch.h"

#include "nvlink/cuda_check.h"

namespace moelink::detail {
namespace {

// One block; a thread per record, word by word (records are small).
__global__ void gather_records(const GatherRecord* table, int count, uint32_t* host) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const auto* src = static_cast<const uint32_t*>(table[i].record);
    uint32_t* dst = host + static_cast<size_t>(i) * (RecordBatch::kMaxRecordBytes / 4);
    for (uint32_t w = 0; w < table[i].bytes / 4; ++w) dst[w] = src[w];
  }
}

}  // namespace

void launch_gather_records(const GatherRecord* table, int count, void* host, cudaStream_t stream) {
  gather_records<<<1, 256, 0, stream>>>(table, count, static_cast<uint32_t*>(host));
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail
