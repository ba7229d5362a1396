// Where the benchmark's tensors live and how time is taken: device memory
// and CUDA events for the NVLink backend, host memory and a host clock for
// the CPU backend. The CPU implementation makes no CUDA call at all, so the
// tool runs on a machine without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "moelink/types.h"

namespace moelink_bench {

// Per-iteration time stamps: mark(i, m) records stamp m of iteration i on the
// stream (CUDA event) or now (host clock); read them after finish().
class Timer {
 public:
  virtual ~Timer() = default;
  virtual void mark(int iter, int stamp) = 0;
  virtual void finish() = 0;  // waits for the stamps to complete
  virtual double elapsed_us(int iter, int from, int to) const = 0;
};

// The identity experts of the correctness check: for local expert j and
// row < counts[j]: y[j][row] = bf16(x[j][row][h] * scale[j][row][h * S / H]).
struct IdentityExperts {
  const void* x;         // [L, C, H] in_dtype
  const float* scales;   // [L, C, S] contiguous, or null when S == 0
  const int32_t* counts; // [L] (platform memory)
  uint16_t* y;           // [L, C, H] bf16
  int L = 0, S = 0;
  int64_t C = 0, H = 0;
  moelink::DType in_dtype = moelink::DType::kFloat8E4M3;
};

class Platform {
 public:
  virtual ~Platform() = default;
  virtual bool gpu() const = 0;
  // Zero-filled, 256-byte aligned. Throws on failure.
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void sync() = 0;
  virtual cudaStream_t stream() const = 0;  // nullptr for the host
  virtual std::unique_ptr<Timer> make_timer(int iters, int stamps) = 0;
  // Records `work` (launches on stream()) into a CUDA graph and returns a
  // function that replays it on the stream. GPU only.
  virtual std::function<void()> capture(const std::function<void()>& work) = 0;
  // Median time between two events around one empty kernel (GPU), the fixed
  // cost each timed phase pays before doing anything; 0 on the host.
  virtual double empty_kernel_us(int iters) = 0;
  virtual void identity_experts(const IdentityExperts& e) = 0;
};

// Owns one platform allocation.
class Mem {
 public:
  Mem() = default;
  Mem(Platform& pl, size_t bytes) : pl_(&pl), p_(pl.alloc(bytes)), bytes_(bytes) {}
  Mem(Mem&& o) noexcept { *this = std::move(o); }
  Mem& operator=(Mem&& o) noexcept {
    reset();
    pl_ = o.pl_;
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.p_ = nullptr;
    return *this;
  }
  ~Mem() { reset(); }
  void reset() {
    if (p_) pl_->release(p_);
    p_ = nullptr;
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  Platform* pl_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<Platform> make_host_platform();
// Sets `device` current and creates a non-blocking stream (cuda_platform.cu).
std::unique_ptr<Platform> make_cuda_platform(int device);

}  // namespace moelink_bench
