// Reading many error records after one step with one copy and one wait.
//
// A model step's objects (its layers' attention, MoE layer, AllToAll,
// expert GEMMs, ...) each keep an error record in device memory, and each
// object's check() reads its own with take_device_record(): a copy and a
// wait per record, some thirty a step on a 5-layer model and hundreds on a
// 61-layer one. A RecordBatch learns which records a check reads (the
// first time, record by record) and from then on gathers them all with one
// kernel into pinned host memory and one wait before the check runs;
// take_device_record() then reads them from there.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace moelink::detail {

// One record a gather copies: its device address and size (the table the
// gather kernel reads).
struct GatherRecord {
  const void* record;
  uint32_t bytes;
};

// What take_device_record() asks of the batch active on its thread.
class RecordSource {
 public:
  virtual ~RecordSource() = default;
  // The record's bytes as gathered, or nullptr: then it is read on its own
  // and, when read on the batch's stream, learned for the next time.
  virtual void* gathered(const void* device_record, size_t bytes, cudaStream_t stream) = 0;
  virtual void learn(const void* device_record, size_t bytes, cudaStream_t stream) = 0;
};

// The batch whose check runs on this thread (null: none).
inline thread_local RecordSource* active_record_source = nullptr;

class RecordBatch final : public RecordSource {
 public:
  // Records larger than this, or of a size not a multiple of 4, are read
  // one by one.
  static constexpr size_t kMaxRecordBytes = 64;

  RecordBatch() = default;
  ~RecordBatch() override;
  RecordBatch(const RecordBatch&) = delete;
  RecordBatch& operator=(const RecordBatch&) = delete;

  // Runs `check` (which reads records with take_device_record) after the
  // records it read before were gathered on `stream`. The records must
  // live as long as this batch (the owner's own objects' records).
  void run(cudaStream_t stream, const std::function<void()>& check);

  void* gathered(const void* device_record, size_t bytes, cudaStream_t stream) override;
  void learn(const void* device_record, size_t bytes, cudaStream_t stream) override;

  size_t size() const { return records_.size(); }

 private:
  void upload();  // the table of records_ to the device

  std::vector<GatherRecord> records_;                 // learned, gathered in this order
  std::unordered_map<const void*, size_t> index_;     // record -> slot
  std::vector<GatherRecord> learned_;                 // new ones of this run
  cudaStream_t stream_ = nullptr;                     // this run's
  bool fresh_ = false;                                // host_ holds this run's copies
  size_t capacity_ = 0;                               // records table_ and host_ hold
  GatherRecord* table_ = nullptr;                     // device: records_
  void* host_ = nullptr;                              // pinned, mapped: kMaxRecordBytes a slot
};

// The gather: table[i]'s bytes to host + i * RecordBatch::kMaxRecordBytes
// (error_record_batch.cu).
void launch_gather_records(const GatherRecord* table, int count, void* host, cudaStream_t stream);

}  // namespace moelink::detail
