// A GPU kernel that waits for a flag in pinned mapped host memory, the way
// a kernel waits for TransferEngine::signal_on_imm, then reads the bytes
// the flag stands for (tests only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moelink_test {

// Written by the kernel (mapped host memory, read by the host after the
// stream synchronized; `started` while it runs).
struct FlagPoll {
  uint64_t started = 0;    // 1 once the kernel polls
  uint64_t seen = 0;       // the flag's value when it stopped polling
  uint64_t timed_out = 0;  // 1: the flag never became `want`
  uint64_t checksum = 0;   // data_checksum() of `data` read after the flag
  uint64_t done = 0;       // 1 once the fields above are written
};

// The checksum the kernel computes over `words` 8-byte words: sum of
// word[i] * (i + 1), so misplaced words count too.
uint64_t data_checksum(const uint64_t* words, size_t n);

// One thread on `stream` polls *flag (acquire, system scope) until it
// equals `want` or `timeout_ns` pass, then reads `words` words of `data`.
// flag, data and out: pinned host memory mapped into the device
// (cudaHostAllocMapped; with unified addressing the host pointers work).
cudaError_t launch_flag_poll(const uint64_t* flag, uint64_t want, const uint64_t* data,
                             size_t words, uint64_t timeout_ns, FlagPoll* out,
                             cudaStream_t stream);

}  // namespace moelink_test
