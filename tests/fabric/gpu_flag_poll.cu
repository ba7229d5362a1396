#include "gpu_flag_poll.h"

namespace moelink_test {
namespace {

__device__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void flag_poll_kernel(const uint64_t* flag, uint64_t want, const uint64_t* data,
                                 size_t words, uint64_t timeout_ns, FlagPoll* out) {
  volatile FlagPoll* o = out;
  o->started = 1;
  __threadfence_system();
  const uint64_t t0 = now_ns();
  uint64_t v = load_acquire_sys(flag);
  while (v != want) {
    if (now_ns() - t0 > timeout_ns) {
      o->timed_out = 1;
      break;
    }
    __nanosleep(200);
    v = load_acquire_sys(flag);
  }
  // After the acquire: the bytes the engine counted before raising the flag.
  const volatile uint64_t* d = data;
  uint64_t sum = 0;
  for (size_t i = 0; i < words; ++i) sum += d[i] * (i + 1);
  o->seen = v;
  o->checksum = sum;
  __threadfence_system();
  o->done = 1;
}

}  // namespace

uint64_t data_checksum(const uint64_t* words, size_t n) {
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) sum += words[i] * (i + 1);
  return sum;
}

cudaError_t launch_flag_poll(const uint64_t* flag, uint64_t want, const uint64_t* data,
                             size_t words, uint64_t timeout_ns, FlagPoll* out,
                             cudaStream_t stream) {
  flag_poll_kernel<<<1, 1, 0, stream>>>(flag, want, data, words, timeout_ns, out);
  return cudaGetLastError();
}

}  // namespace moelink_test
