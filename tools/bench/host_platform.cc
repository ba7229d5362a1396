// Host memory and a host clock for the CPU backend: the CPU backend's calls
// are synchronous, so a time stamp taken after a call returns is the end of
// its work.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "numeric.h"
#include "platform.h"

namespace moelink_bench {

namespace {

class HostTimer : public Timer {
 public:
  HostTimer(int iters, int stamps) : stamps_(stamps), t_(static_cast<size_t>(iters) * stamps) {}
  void mark(int iter, int stamp) override {
    t_[static_cast<size_t>(iter) * stamps_ + stamp] = std::chrono::steady_clock::now();
  }
  void finish() override {}
  double elapsed_us(int iter, int from, int to) const override {
    const size_t b = static_cast<size_t>(iter) * stamps_;
    return std::chrono::duration<double, std::micro>(t_[b + to] - t_[b + from]).count();
  }

 private:
  int stamps_;
  std::vector<std::chrono::steady_clock::time_point> t_;
};

class HostPlatform : public Platform {
 public:
  bool gpu() const override { return false; }
  void* alloc(size_t bytes) override {
    size_t n = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n == 0 ? 256 : n);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, n == 0 ? 256 : n);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void sync() override {}
  cudaStream_t stream() const override { return nullptr; }
  std::function<void()> capture(const std::function<void()>& work) override { return work; }
  double empty_kernel_us(int) override { return 0.0; }
  std::unique_ptr<Timer> make_timer(int iters, int stamps) override {
    return std::make_unique<HostTimer>(iters, stamps);
  }
  void identity_experts(const IdentityExperts& e) override {
    const size_t es = moelink::dtype_size(e.in_dtype);
    for (int j = 0; j < e.L; ++j)
      for (int64_t row = 0; row < e.counts[j] && row < e.C; ++row) {
        const int64_t r = j * e.C + row;
        const auto* x = static_cast<const uint8_t*>(e.x) + r * e.H * es;
        for (int64_t h = 0; h < e.H; ++h) {
          float s = e.S > 0 ? e.scales[r * e.S + scale_index(h, e.H, e.S)] : 1.0f;
          e.y[r * e.H + h] = float_to_bf16(load_token_elem(x, e.in_dtype, h) * s);
        }
      }
  }
};

}  // namespace

std::unique_ptr<Platform> make_host_platform() { return std::make_unique<HostPlatform>(); }

}  // namespace moelink_bench
