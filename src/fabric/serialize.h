// Byte writer/reader for the engine's serializable descriptors.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moelink/errors.h"

namespace moelink::fabric {

class ByteWriter {
 public:
  void u64(uint64_t v) { put(&v, sizeof(v)); }
  void str(const std::string& s) {
    u64(s.size());
    put(s.data(), s.size());
  }
  std::vector<char> take() { return std::move(out_); }

 private:
  void put(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    out_.insert(out_.end(), c, c + n);
  }
  std::vector<char> out_;
};

class ByteReader {
 public:
  ByteReader(const void* data, size_t size, const char* what)
      : p_(static_cast<const char*>(data)), left_(size), what_(what) {}
  uint64_t u64() {
    uint64_t v;
    get(&v, sizeof(v));
    return v;
  }
  std::string str() {
    const uint64_t n = u64();
    if (n > left_) fail();
    std::string s(p_, n);
    p_ += n;
    left_ -= n;
    return s;
  }
  void expect_end() {
    if (left_ != 0) fail();
  }

 private:
  void get(void* v, size_t n) {
    if (n > left_) fail();
    std::memcpy(v, p_, n);
    p_ += n;
    left_ -= n;
  }
  [[noreturn]] void fail() {
    throw InvalidArgument(std::string("malformed serialized ") + what_);
  }
  const char* p_;
  size_t left_;
  const char* what_;
};

}  // namespace moelink::fabric
