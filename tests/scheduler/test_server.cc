// The gRPC server with the C++ engine and submit clients, over loopback.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <thread>

#include "moelink/scheduler/client.h"
#include "moelink/scheduler/engine_client.h"
#include "moelink/scheduler/server.h"
#include "scheduler_test_util.h"

namespace moelink::scheduler {
namespace {

using testing::expect_status;
using testing::generate_request;
using testing::TempDir;

// A tiny engine on EngineClient: each request gets its prompt length + 1,
// +2, ... as output, reported STARTED (acknowledged) before any token.
class EchoEngine {
 public:
  EchoEngine(const std::string& target, const std::string& id, const std::string& token = "") {
    EngineClientOptions o;
    o.target = target;
    o.engine_token = token;
    o.info.set_engine_id(id);
    o.info.set_kv_capacity_blocks(1024);
    o.info.set_block_size(16);
    o.info.set_max_batch(8);
    EngineHandlers h;
    h.on_run = [this](const v1::RunRequest& r) {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(r);
      cv_.notify_all();
    };
    client_ = std::make_unique<EngineClient>(o, h);
  }
  ~EchoEngine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  void start(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    client_->start(timeout);
    worker_ = std::thread([this] { run(); });
  }
  EngineClient& client() { return *client_; }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) break;
      v1::RunRequest r = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::vector<v1::RequestProgress> p(1);
      p[0].set_request_id(r.request_id());
      p[0].set_phase(v1::RequestProgress::STARTED);
      if (client_->report({}, {}, p).status.ok()) {
        for (uint32_t i = 0; i < r.sampling().max_new_tokens(); ++i) {
          p[0].set_phase(i + 1 == r.sampling().max_new_tokens() ? v1::RequestProgress::FINISHED
                                                                 : v1::RequestProgress::RUNNING);
          p[0].clear_new_tokens();
          p[0].add_new_tokens(r.prompt_tokens_size() + i + 1);
          p[0].set_token_offset(i);
          client_->report({}, {}, p);
        }
      }
      lock.lock();
    }
  }
  std::unique_ptr<EngineClient> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::RunRequest> queue_;
  bool stop_ = false;
  std::thread worker_;
};

SchedulerOptions loopback() {
  SchedulerOptions o;
  o.listen = "127.0.0.1:0";
  return o;
}

std::string target_of(const SchedulerServer& s) { return "127.0.0.1:" + std::to_string(s.port()); }

TEST(Server, RequestsFlowThroughRealGrpc) {
  SchedulerServer server(loopback());
  EchoEngine a(target_of(server), "a"), b(target_of(server), "b");
  a.start();
  b.start();
  SchedulerClient client(target_of(server));
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      std::vector<uint32_t> prompt(10 + t, 1);
      std::vector<uint32_t> out;
      bool finished = false;
      grpc::Status s = client.generate(generate_request(prompt, 5), [&](const v1::GenerateEvent& ev) {
        if (ev.has_tokens())
          out.insert(out.end(), ev.tokens().token_ids().begin(), ev.tokens().token_ids().end());
        if (ev.has_finished()) finished = true;
      });
      std::vector<uint32_t> want;
      for (uint32_t i = 1; i <= 5; ++i) want.push_back(static_cast<uint32_t>(prompt.size()) + i);
      if (s.ok() && finished && out == want) ++ok;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  v1::Stats st;
  ASSERT_TRUE(client.stats(&st).ok());
  EXPECT_EQ(st.finished(), 8u);
  EXPECT_EQ(st.engines_size(), 2);
  EXPECT_GT(st.decision_p99_us(), 0.0);
}

TEST(Server, BadRequestsGetAStatusNotACrash) {
  SchedulerServer server(loopback());
  SchedulerClient client(target_of(server));
  grpc::Status s = client.generate(generate_request({}, 4), nullptr);
  expect_status(s, grpc::StatusCode::INVALID_ARGUMENT, {"prompt_tokens is empty"});
  s = client.generate(generate_request(std::vector<uint32_t>(200000, 3), 4), nullptr);
  expect_status(s, grpc::StatusCode::OUT_OF_RANGE, {"200000 tokens"});
  v1::Stats st;
  EXPECT_TRUE(client.stats(&st).ok());
}

TEST(Server, EngineTokenIsRequiredWhenSet) {
  SchedulerOptions o = loopback();
  o.engine_token = "s3cret";
  SchedulerServer server(o);
  EchoEngine wrong(target_of(server), "w", "guess");
  try {
    wrong.start(std::chrono::milliseconds(1500));
    FAIL() << "registered with a wrong token";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("engine token missing or wrong"), std::string::npos) << e.what();
  }
  EchoEngine right(target_of(server), "r", "s3cret");
  right.start();
  SchedulerClient client(target_of(server));
  EXPECT_TRUE(client.generate(generate_request({1, 2, 3}, 2), nullptr).ok());
}

TEST(Server, RefusesToListenBeyondLoopbackWithoutAuthentication) {
  SchedulerOptions o;
  o.listen = "0.0.0.0:0";
  try {
    SchedulerServer server(o);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--engine-token"), std::string::npos);
  }
  o.allow_insecure_remote = true;
  SchedulerServer server(o);
  EXPECT_GT(server.port(), 0);
}

TEST(Server, MutualTls) {
  if (std::system("openssl version > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "openssl (the command) is not installed: cannot make test certificates";
  TempDir dir;
  const std::string d = dir.file("");
  // A CA, a server certificate for localhost and a client certificate.
  const std::string cmd =
      "cd " + d + " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "-subj /CN=moelink-test-ca 2>/dev/null && "
      "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost 2>/dev/null && "
      "printf 'subjectAltName=DNS:localhost' > san.ext && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
      "-days 1 -extfile san.ext 2>/dev/null && "
      "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=engine "
      "2>/dev/null && openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out client.pem -days 1 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "could not make certificates";
  auto read = [&](const char* f) {
    std::ifstream in(d + f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  SchedulerOptions o;
  o.listen = "localhost:0";
  o.tls_cert = d + "server.pem";
  o.tls_key = d + "server.key";
  o.tls_client_ca = d + "ca.pem";
  SchedulerServer server(o);
  const std::string target = "localhost:" + std::to_string(server.port());
  grpc::SslCredentialsOptions with_cert{read("ca.pem"), read("client.key"), read("client.pem")};
  SchedulerClient ok(target, grpc::SslCredentials(with_cert));
  v1::Stats st;
  EXPECT_TRUE(ok.stats(&st).ok());
  grpc::SslCredentialsOptions no_cert{read("ca.pem"), "", ""};
  SchedulerClient refused(target, grpc::SslCredentials(no_cert));
  EXPECT_FALSE(refused.stats(&st).ok());
  SchedulerClient plain(target);
  EXPECT_FALSE(plain.stats(&st).ok());
}

}  // namespace
}  // namespace moelink::scheduler
