// CUDA error checks for host code: every runtime call's status is checked
// and turned into a SystemError naming the call and where it was made.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "core/layout.h"
#include "nvlink/cuda_release.h"
#include "nvlink/error_record_batch.h"
#include "moelink/errors.h"

namespace moelink::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw SystemError(std::string("moelink: CUDA error in ") + what + " (" + file + ":" +
                    std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                    cudaGetErrorString(err));
}

}  // namespace moelink::detail

#define MOELINK_CUDA_CHECK(call)                                                     \
  do {                                                                               \
    cudaError_t moelink_err_ = (call);                                               \
    if (moelink_err_ != cudaSuccess)                                                 \
      ::moelink::detail::throw_cuda_error(moelink_err_, #call, __FILE__, __LINE__);  \
  } while (0)

namespace moelink::detail {

inline constexpr size_t kPinnedRecordBytes = 256;

// The calling thread's pinned host buffer for reading error records back
// (allocated on first use and kept for the thread's life: freeing it at
// thread exit could run after the CUDA runtime is gone).
inline void* pinned_record_copy() {
  thread_local void* buffer = nullptr;
  if (buffer == nullptr) {
    RelaxedCaptureMode relaxed;  // another thread may be capturing
    MOELINK_CUDA_CHECK(cudaMallocHost(&buffer, kPinnedRecordBytes));
  }
  return buffer;
}

// An error record kernels write in device memory (a `code` of 0 is none),
// read after the work on `stream` finished and cleared when `clear(record)`
// says so. Inside a capture nothing can be waited for: reports nothing.
template <class Record, class Clear>
Record take_device_record(cudaStream_t stream, Record* device_record, Clear clear) {
  Record e{};
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOELINK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return e;
  // Within a RecordBatch's run (Model.check): the copy gathered with the
  // others before the check, else read here and learned for next time.
  if (RecordSource* batch = active_record_source) {
    if (void* copy = batch->gathered(device_record, sizeof(Record), stream)) {
      std::memcpy(&e, copy, sizeof(e));
      if (e.code != 0 && clear(e)) {
        MOELINK_CUDA_CHECK(cudaMemset(device_record, 0, sizeof(Record)));
        std::memset(copy, 0, sizeof(Record));  // a second reader in this check sees it cleared
      }
      return e;
    }
    batch->learn(device_record, sizeof(Record), stream);
  }
  // One copy on the stream into pinned memory and one wait: a model step
  // reads some thirty records after every step, and a synchronous
  // cudaMemcpy to pageable memory (a wait, a staged copy, a second wait)
  // costs several times that each.
  static_assert(sizeof(Record) <= kPinnedRecordBytes, "an error record larger than the pinned copy");
  void* pinned = pinned_record_copy();
  MOELINK_CUDA_CHECK(cudaMemcpyAsync(pinned, device_record, sizeof(e), cudaMemcpyDeviceToHost, stream));
  MOELINK_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::memcpy(&e, pinned, sizeof(e));
  if (e.code != 0 && clear(e)) MOELINK_CUDA_CHECK(cudaMemset(device_record, 0, sizeof(Record)));
  return e;
}

// A backend's error record: cleared unless it is a timeout (final).
inline ErrorRecord take_device_error(cudaStream_t stream, ErrorRecord* device_record) {
  return take_device_record(stream, device_record, [](const ErrorRecord& e) {
    return static_cast<ErrorCode>(e.code) != ErrorCode::kTimeout;
  });
}

}  // namespace moelink::detail
