#include "moelink/plan/profiles.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#ifndef MOELINK_PLAN_PROFILES_DIR
#define MOELINK_PLAN_PROFILES_DIR "profiles"
#endif

namespace moelink::plan {
namespace fs = std::filesystem;

std::string default_profiles_dir() {
  if (const char* env = std::getenv("MOELINK_PLAN_PROFILES"); env && *env) return env;
  return MOELINK_PLAN_PROFILES_DIR;
}

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw PlanError("cannot read '" + path + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

namespace {
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}
bool is_path(const std::string& s) {
  return s.find('/') != std::string::npos || (s.size() > 5 && s.substr(s.size() - 5) == ".json");
}
}  // namespace

ProfileStore::ProfileStore(std::string dir) : dir_(std::move(dir)) {}

std::vector<std::string> ProfileStore::list(const std::string& kind) const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(dir_) / kind, ec))
    if (e.path().extension() == ".json") out.push_back(e.path().stem().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string ProfileStore::read(const std::string& kind, const std::string& name_or_path,
                               std::string* name) const {
  if (is_path(name_or_path)) {
    *name = fs::path(name_or_path).stem().string();
    if (*name == "config") *name = fs::path(name_or_path).parent_path().filename().string();
    return read_text_file(name_or_path);
  }
  for (const auto& n : list(kind)) {
    if (lower(n) == lower(name_or_path)) {
      *name = n;
      return read_text_file((fs::path(dir_) / kind / (n + ".json")).string());
    }
  }
  std::string valid;
  for (const auto& n : list(kind)) valid += (valid.empty() ? "" : ", ") + n;
  std::string singular = kind.substr(0, kind.size() - 1);
  throw PlanError("unknown " + singular + " '" + name_or_path + "'; valid: " +
                  (valid.empty() ? "(none found in " + dir_ + "/" + kind + ")" : valid) +
                  (kind == "models" ? " (or a path to a Hugging Face config.json)" : ""));
}

ModelSpec ProfileStore::model(const std::string& n) const {
  std::string name;
  std::string text = read("models", n, &name);
  return model_from_json_text(text, name);
}
GpuProfile ProfileStore::gpu(const std::string& n) const {
  std::string name;
  std::string text = read("gpus", n, &name);
  return gpu_from_json_text(text, name);
}
NetworkProfile ProfileStore::network(const std::string& n) const {
  std::string name;
  std::string text = read("networks", n, &name);
  return network_from_json_text(text, name);
}

}  // namespace moelink::plan
