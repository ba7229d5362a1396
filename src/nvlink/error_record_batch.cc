#include "nvlink/error_record_batch.h"

#include <algorithm>

#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail {

RecordBatch::~RecordBatch() {
  RelaxedCaptureMode relaxed;  // destroyed while another thread may capture
  release_device_memory(table_);
  if (host_ != nullptr) cudaFreeHost(host_);
}

void RecordBatch::run(cudaStream_t stream, const std::function<void()>& check) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOELINK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) {  // nothing is read inside a capture
    check();
    return;
  }
  stream_ = stream;
  fresh_ = false;
  learned_.clear();
  if (!records_.empty()) {
    launch_gather_records(table_, static_cast<int>(records_.size()), host_, stream);
    MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream));
    fresh_ = true;
  }
  RecordSource* outer = active_record_source;
  active_record_source = this;
  auto finish = [&] {
    active_record_source = outer;
    fresh_ = false;
    bool grew = false;
    for (const GatherRecord& e : learned_) {
      if (index_.count(e.record) != 0) continue;
      index_.emplace(e.record, records_.size());
      records_.push_back(e);
      grew = true;
    }
    learned_.clear();
    if (grew) upload();
  };
  try {
    check();
  } catch (...) {
    finish();
    throw;
  }
  finish();
}

void* RecordBatch::gathered(const void* device_record, size_t bytes, cudaStream_t stream) {
  if (!fresh_ || stream != stream_) return nullptr;
  const auto it = index_.find(device_record);
  if (it == index_.end() || records_[it->second].bytes != bytes) return nullptr;
  return static_cast<char*>(host_) + it->second * kMaxRecordBytes;
}

void RecordBatch::learn(const void* device_record, size_t bytes, cudaStream_t stream) {
  if (stream != stream_ || bytes > kMaxRecordBytes || bytes % 4 != 0) return;
  learned_.push_back({device_record, static_cast<uint32_t>(bytes)});
}

void RecordBatch::upload() {
  RelaxedCaptureMode relaxed;  // another thread may be capturing
  const size_t n = records_.size();
  if (n > capacity_) {
    release_device_memory(table_);
    if (host_ != nullptr) cudaFreeHost(host_);
    table_ = nullptr;
    host_ = nullptr;
    capacity_ = 0;
    const size_t capacity = std::max<size_t>(64, 2 * n);
    MOELINK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&table_), capacity * sizeof(GatherRecord)));
    MOELINK_CUDA_CHECK(cudaHostAlloc(&host_, capacity * kMaxRecordBytes, cudaHostAllocMapped));
    capacity_ = capacity;
  }
  // On the stream the gathers run on (ordered before the next one).
  MOELINK_CUDA_CHECK(
      cudaMemcpyAsync(table_, records_.data(), n * sizeof(GatherRecord), cudaMemcpyHostToDevice, stream_));
  MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream_));  // records_ may change before the next run
}

}  // namespace moelink::detail
