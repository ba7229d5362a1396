// The memory half of the per-device interfaces of the parts built on the
// public objects (the MoE layer's LayerDevice, the attention's and the
// model's ops): where their buffers live and how bytes move in and out,
// with the host implementation written once.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>


namespace moelink::detail {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual bool host_memory() const = 0;
  // Zeroed memory of the device's kind; freed by free().
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // From host or device memory into the device's memory (and back), synchronous.
  virtual void copy_in(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_out(void* dst, const void* src, size_t bytes) = 0;
};

// DeviceMemory in host memory, for the host implementations of an
// interface `Base` derived from DeviceMemory.
template <class Base>
class HostMemory : public Base {
 public:
  bool host_memory() const override { return true; }
  void* alloc(size_t bytes) override {
    void* p = std::calloc(bytes > 0 ? bytes : 1, 1);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void free(void* p) override { std::free(p); }
  void copy_in(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_out(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
};

// Memory of a DeviceMemory's kind that frees itself (a constructor that
// throws half-way frees what it had allocated).
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  OwnedBuffer(DeviceMemory& mem, size_t bytes) : mem_(&mem), p_(mem.alloc(bytes)), bytes_(bytes) {}
  OwnedBuffer(OwnedBuffer&& o) noexcept : mem_(o.mem_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  OwnedBuffer& operator=(OwnedBuffer&& o) noexcept {
    std::swap(mem_, o.mem_);
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;
  ~OwnedBuffer() {
    if (p_ != nullptr) mem_->free(p_);
  }
  void* get() const { return p_; }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  DeviceMemory* mem_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace moelink::detail
