// Writes safetensors files for the tests that load checkpoints: an 8-byte
// little-endian header length, the JSON header, the raw bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moelink_test {

struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};
inline void write_safetensors(const std::string& path, const std::map<std::string, StTensor>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    h[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string header = h.dump();
  while (header.size() % 8) header += ' ';
  std::ofstream f(path, std::ios::binary);
  const uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((len >> (8 * i)) & 0xff));
  f << header;
  for (const auto& [name, t] : tensors) f.write(t.bytes.data(), static_cast<std::streamsize>(t.bytes.size()));
}

template <class T>
StTensor st(const char* dtype, std::vector<int64_t> shape, const T* data, size_t count) {
  StTensor t{dtype, std::move(shape), std::vector<char>(count * sizeof(T))};
  std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}

}  // namespace moelink_test
