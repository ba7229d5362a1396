// Big-endian byte writer/reader for the verbs wire formats (handshake
// messages, endpoint addresses). The reader does not check bounds: callers
// check the total size first (both formats are fixed-size).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace moelink::fabric::verbs {

class BeWriter {
 public:
  explicit BeWriter(std::vector<uint8_t>& b) : b_(b) {}
  void u8(uint8_t v) { b_.push_back(v); }
  void u16(uint16_t v) { be(v, 2); }
  void u32(uint32_t v) { be(v, 4); }
  void u64(uint64_t v) { be(v, 8); }
  void bytes(const uint8_t* p, size_t n) { b_.insert(b_.end(), p, p + n); }

 private:
  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) b_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t>& b_;
};

class BeReader {
 public:
  explicit BeReader(std::span<const uint8_t> b) : b_(b) {}
  uint8_t u8() { return static_cast<uint8_t>(be(1)); }
  uint16_t u16() { return static_cast<uint16_t>(be(2)); }
  uint32_t u32() { return static_cast<uint32_t>(be(4)); }
  uint64_t u64() { return be(8); }
  void bytes(uint8_t* p, size_t n) {
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
  }

 private:
  uint64_t be(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | b_[pos_++];
    return v;
  }
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

}  // namespace moelink::fabric::verbs
