#include "layer/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "moelink/errors.h"

namespace moelink::detail::layer {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw InvalidArgument("moelink: MoELayer.load_checkpoint: " + what);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail("cannot open " + path + ": " + std::strerror(errno));
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// Reads exactly n bytes at `offset` of an open file.
void pread_all(int fd, void* out, uint64_t n, uint64_t offset, const std::string& file) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) fail("reading " + file + " failed at byte " + std::to_string(offset) +
                       (got < 0 ? std::string(": ") + std::strerror(errno) : ": file too short"));
    p += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

struct Fd {
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) fail("cannot open " + path + ": " + std::strerror(errno));
  }
  ~Fd() { ::close(fd); }
  int fd;
};

}  // namespace

SafetensorsDir::SafetensorsDir(const std::string& directory) : directory_(directory) {
  const std::string index = directory + "/model.safetensors.index.json";
  std::set<std::string> names;
  if (::access(index.c_str(), R_OK) == 0) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text(index));
    } catch (const nlohmann::json::exception& e) {
      fail(index + " is not valid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index + " has no weight_map object");
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string()) fail(index + ": weight_map[" + tensor + "] is not a file name");
      names.insert(file.get<std::string>());
    }
  } else {
    DIR* d = ::opendir(directory.c_str());
    if (d == nullptr) fail("cannot open the directory " + directory + ": " + std::strerror(errno));
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) names.insert(n);
    }
    ::closedir(d);
    if (names.empty())
      fail(directory + " has no *.safetensors file and no model.safetensors.index.json");
  }
  for (const std::string& n : names) read_header(directory + "/" + n);
}

void SafetensorsDir::read_header(const std::string& file) {
  Fd f(file);
  uint8_t len_bytes[8];
  pread_all(f.fd, len_bytes, 8, 0, file);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len == 0 || len > (uint64_t{100} << 20)) fail(file + ": header length " + std::to_string(len) + " is not a safetensors header");
  std::string header(len, '\0');
  pread_all(f.fd, header.data(), len, 8, file);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    fail(file + ": the header is not valid JSON: " + e.what());
  }
  const off_t size = ::lseek(f.fd, 0, SEEK_END);
  const uint64_t data_start = 8 + len;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    try {
      SafetensorEntry e;
      e.file = file;
      e.dtype = v.at("dtype").get<std::string>();
      e.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[1] < off[0]) fail(file + ": tensor " + name + " has bad data_offsets");
      e.offset = data_start + off[0];
      e.bytes = off[1] - off[0];
      if (e.offset + e.bytes > static_cast<uint64_t>(size))
        fail(file + ": tensor " + name + " ends past the end of the file");
      files_.push_back(file);
      tensors_[name] = std::move(e);
    } catch (const nlohmann::json::exception& ex) {
      fail(file + ": tensor " + name + " has a malformed header entry: " + ex.what());
    }
  }
  std::sort(files_.begin(), files_.end());
  files_.erase(std::unique(files_.begin(), files_.end()), files_.end());
}

const SafetensorEntry* SafetensorsDir::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void SafetensorsDir::read(const SafetensorEntry& entry, void* out) const {
  read(entry, 0, entry.bytes, out);
}

void SafetensorsDir::read(const SafetensorEntry& entry, uint64_t from, uint64_t bytes,
                          void* out) const {
  if (from + bytes > entry.bytes)
    fail(entry.file + ": reading bytes " + std::to_string(from) + ".." + std::to_string(from + bytes) +
         " of a tensor of " + std::to_string(entry.bytes));
  Fd f(entry.file);
  pread_all(f.fd, out, bytes, entry.offset + from, entry.file);
}

}  // namespace moelink::detail::layer
