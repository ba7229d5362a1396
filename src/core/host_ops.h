// Host-side helpers of the backends whose loops run on the CPU (kCPU and
// kInternodeCPU): strided element addresses, unaligned scalar access, fp32
// row accumulation, and the polling policy for waits on peers.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/float_convert.h"
#include "moelink/types.h"

namespace moelink::detail {

// Address of element (i0, i1, i2) of a strided tensor (unused trailing
// indices must be 0).
inline char* elem(const Tensor& t, int64_t i0, int64_t i1 = 0, int64_t i2 = 0) {
  int64_t off = i0 * t.stride[0];
  if (t.ndim > 1) off += i1 * t.stride[1];
  if (t.ndim > 2) off += i2 * t.stride[2];
  return static_cast<char*>(t.data) + off * static_cast<int64_t>(dtype_size(t.dtype));
}

// Scalars in caller tensors may be unaligned views and shared memory holds no
// C++ objects: copy bytes instead of dereferencing casted pointers.
template <typename T>
T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
void store(void* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Flags are the only words two processes touch concurrently. The release
// store orders every earlier write of this thread (slots, combine rows)
// before the flag; the acquire load orders the reader's later reads after it.
inline uint64_t load_flag(const char* p) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(const_cast<char*>(p)))
      .load(std::memory_order_acquire);
}
inline void store_flag(char* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(p)).store(v, std::memory_order_release);
}

// Polling policy for waits on peers. Several ranks usually share few cores
// here, so after a short spin the waiter gives its core away, and soon sleeps.
class Backoff {
 public:
  void pause() {
    ++n_;
    if (n_ < 64) return;
    if (n_ < 256) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(n_ < 2048 ? 20 : 200));
  }

 private:
  int n_ = 0;
};

// acc[h] += w * row[h] for a row of bf16, fp16 or fp32 values.
inline void add_scaled(float* acc, const void* row, DType t, int64_t n, float w) {
  switch (t) {
    case DType::kBFloat16:
      for (int64_t h = 0; h < n; ++h)
        acc[h] += w * bf16_to_f32(static_cast<const uint16_t*>(row)[h]);
      break;
    case DType::kFloat16:
      for (int64_t h = 0; h < n; ++h)
        acc[h] += w * f16_to_f32(static_cast<const uint16_t*>(row)[h]);
      break;
    default:
      for (int64_t h = 0; h < n; ++h) acc[h] += w * static_cast<const float*>(row)[h];
      break;
  }
}

inline void store_row(void* row, DType t, const float* v, int64_t n) {
  for (int64_t h = 0; h < n; ++h) store_from_f32(row, t, h, v[h]);
}

}  // namespace moelink::detail
