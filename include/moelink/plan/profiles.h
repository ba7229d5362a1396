// moelink-plan: finds model, GPU and network profiles by name or path.
#pragma once
#include <string>
#include <vector>

#include "moelink/plan/hardware.h"
#include "moelink/plan/model.h"

namespace moelink::plan {

// The profile tree compiled in (MOELINK_PLAN_PROFILES_DIR), or $MOELINK_PLAN_PROFILES.
std::string default_profiles_dir();

// Profiles live in <dir>/{models,gpus,networks}/<name>.json. Lookups are
// case-insensitive; a name containing '/' or ending in .json is read as a path
// (for models: a Hugging Face config.json). An unknown name throws PlanError
// listing the valid ones.
class ProfileStore {
 public:
  explicit ProfileStore(std::string dir = default_profiles_dir());
  const std::string& dir() const { return dir_; }
  std::vector<std::string> models() const { return list("models"); }
  std::vector<std::string> gpus() const { return list("gpus"); }
  std::vector<std::string> networks() const { return list("networks"); }
  ModelSpec model(const std::string& name_or_path) const;
  GpuProfile gpu(const std::string& name_or_path) const;
  NetworkProfile network(const std::string& name_or_path) const;

 private:
  std::vector<std::string> list(const std::string& kind) const;
  std::string read(const std::string& kind, const std::string& name_or_path, std::string* name) const;
  std::string dir_;
};

std::string read_text_file(const std::string& path);

}  // namespace moelink::plan
