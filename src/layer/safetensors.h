// The tensors of a Hugging Face checkpoint directory in safetensors files:
// each file is an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}} and the raw data (offsets
// relative to the data's start). With model.safetensors.index.json its
// weight_map says which file holds which tensor; without it every
// *.safetensors file of the directory is read. Only headers are read up
// front; a tensor's bytes are read when asked for (pread), so a rank reads
// its own experts only.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moelink::detail::layer {

struct SafetensorEntry {
  std::string file;   // path
  std::string dtype;  // "F8_E4M3", "BF16", "F16", "F32", ...
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // bytes from the start of the file
  uint64_t bytes = 0;
};

class SafetensorsDir {
 public:
  // Throws InvalidArgument naming the directory or file when it cannot be
  // read or is not a safetensors checkpoint.
  explicit SafetensorsDir(const std::string& directory);

  const std::string& directory() const { return directory_; }
  // Null when no file holds `name`.
  const SafetensorEntry* find(const std::string& name) const;
  // The files read (for messages).
  const std::vector<std::string>& files() const { return files_; }
  // Reads a tensor's bytes into `out` (exactly entry.bytes), or `bytes`
  // bytes from byte `from` of the tensor.
  void read(const SafetensorEntry& entry, void* out) const;
  void read(const SafetensorEntry& entry, uint64_t from, uint64_t bytes, void* out) const;

 private:
  void read_header(const std::string& file);
  std::string directory_;
  std::vector<std::string> files_;
  std::map<std::string, SafetensorEntry> tensors_;
};

}  // namespace moelink::detail::layer
