// Shared pieces of the scheduler tests: a recording Sink, temporary files,
// request builders.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "moelink/scheduler/v1/scheduler.pb.h"
#include "scheduler/core/sink.h"

namespace moelink::scheduler::testing {

template <class Msg>
class RecordingSink final : public Sink<Msg> {
 public:
  bool send(Msg m) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    msgs_.push_back(std::move(m));
    return true;
  }
  void close(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    status_ = s;
  }
  std::vector<Msg> messages() const {
    std::lock_guard<std::mutex> lock(mu_);
    return msgs_;
  }
  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }
  grpc::Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    msgs_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::vector<Msg> msgs_;
  bool closed_ = false;
  grpc::Status status_;
};

// A directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moelink-sched-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::vector<uint32_t> random_tokens(size_t n, std::mt19937& rng) {
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = rng() % 100000;
  return t;
}

inline v1::GenerateRequest generate_request(const std::vector<uint32_t>& prompt, uint32_t max_new,
                                            const std::string& id = "",
                                            const std::string& session = "") {
  v1::GenerateRequest r;
  r.set_request_id(id);
  r.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.set_session_id(session);
  return r;
}

// Expects `s` to fail with `code` and a message containing every one of `words`.
inline void expect_status(const grpc::Status& s, grpc::StatusCode code,
                          std::initializer_list<const char*> words) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  for (const char* w : words)
    EXPECT_NE(s.error_message().find(w), std::string::npos)
        << "'" << w << "' missing from: " << s.error_message();
}

}  // namespace moelink::scheduler::testing
