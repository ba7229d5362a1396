// The gRPC server with the C++ engine and submit clients, over loopback.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <thread>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include "moelink/scheduler/client.h"
#include "moelink/scheduler/engine_client.h"
#include "moelink/scheduler/server.h"
#include "scheduler/server/parse_request.h"
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

// Sends `bytes` as the request of `method` through a generic call (one
// message, then half-close: what a unary or a server-streaming stub sends)
// and returns the call's status. A 10 s deadline: never a hang.
grpc::Status raw_call(const std::string& target, const std::string& method, const std::string& bytes) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  void* tag;
  bool ok = false;
  auto wait = [&] { EXPECT_TRUE(cq.Next(&tag, &ok)); };
  call->StartCall(nullptr);
  wait();
  grpc::Slice slice(bytes);
  call->WriteLast(grpc::ByteBuffer(&slice, 1), grpc::WriteOptions(), nullptr);
  wait();
  grpc::ByteBuffer response;
  do {
    call->Read(&response, nullptr);
    wait();
  } while (ok);
  grpc::Status status;
  call->Finish(&status, nullptr);
  wait();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// Bytes that are not the method's message get INVALID_ARGUMENT naming the
// message and, where the bytes tell, the field; not gRPC's bare
// UNIMPLEMENTED, which reads as a missing method. Every method, unary and
// streaming.
TEST(Server, UnparsableRequestsGetInvalidArgumentNamingTheMessageAndField) {
  SchedulerServer server(loopback());
  const std::string target = target_of(server);
  const std::string gw = "/moelink.scheduler.v1.EngineGateway/", fe = "/moelink.scheduler.v1.Frontend/";
  const std::string garbage(11, '\xff');  // a tag varint longer than 10 bytes
  const std::pair<std::string, const char*> methods[] = {
      {gw + "Register", "RegisterRequest"},
      {gw + "ReceiveAssignments", "ReceiveAssignmentsRequest"},  // streaming
      {gw + "Report", "EngineReport"},
      {gw + "Leave", "LeaveRequest"},
      {fe + "Generate", "GenerateRequest"},  // streaming
      {fe + "Resume", "ResumeRequest"},      // streaming
      {fe + "Cancel", "CancelRequest"},
      {fe + "GetStats", "StatsRequest"},
  };
  for (const auto& [method, message] : methods) {
    SCOPED_TRACE(method);
    const std::string want = std::string("could not parse ") + message + " (11 bytes)";
    expect_status(raw_call(target, method, garbage), grpc::StatusCode::INVALID_ARGUMENT,
                  {want.c_str(), "byte 0", "field tag"});
  }
  // A field cut short: a prompt of 100 tokens (200 bytes), the last 50 bytes missing.
  std::string bytes = generate_request(std::vector<uint32_t>(100, 300), 4, "cut").SerializeAsString();
  bytes.resize(bytes.size() - 50);
  expect_status(raw_call(target, fe + "Generate", bytes), grpc::StatusCode::INVALID_ARGUMENT,
                {"could not parse GenerateRequest", "prompt_tokens (field 2)", "200 bytes",
                 "runs past the end of the message"});
  // In a nested message: EngineReport.load (4) holding running (1), a varint cut short.
  expect_status(raw_call(target, gw + "Report", std::string("\x22\x02\x08\xff", 4)),
                grpc::StatusCode::INVALID_ARGUMENT,
                {"could not parse EngineReport", "load.running (field 1) at byte 2", "varint is cut short"});
  // A string that is not UTF-8, and a wire type beyond 5.
  expect_status(raw_call(target, fe + "Resume", std::string("\x0a\x02\xc3\x28", 4)),
                grpc::StatusCode::INVALID_ARGUMENT,
                {"could not parse ResumeRequest", "request_id (field 1)", "not valid UTF-8"});
  expect_status(raw_call(target, fe + "Cancel", std::string("\x0f", 1)), grpc::StatusCode::INVALID_ARGUMENT,
                {"could not parse CancelRequest", "request_id (field 1)", "wire type 7", "0-5"});
  // Well-formed bytes still work, unknown fields included (field 100 = 1).
  EXPECT_TRUE(raw_call(target, fe + "GetStats", std::string("\xa0\x06\x01", 3)).ok());
  // An unknown method keeps gRPC's UNIMPLEMENTED.
  EXPECT_EQ(raw_call(target, fe + "Nope", "").error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

// The walk that names the field accepts what protobuf accepts.
TEST(ParseRequest, WalkFindsNothingWrongInValidBytes) {
  v1::EngineReport r;
  r.set_engine_id("e");
  r.mutable_load()->set_running(3);
  auto* st = r.add_kv_events()->mutable_stored();
  st->add_block_hashes(~0ull);
  st->set_parent_block_hash(5);
  std::string bytes = r.SerializeAsString();
  // Unknown fields of every wire type, a group among them, and
  // block_hashes unpacked (field 5 > stored 1 > block_hashes 1, varint).
  static const char extra[] =
      "\xa0\x06\x01"                                  // field 100, varint
      "\xa9\x06\x01\x02\x03\x04\x05\x06\x07\x08"          // field 101, 8 bytes
      "\xad\x06\x01\x02\x03\x04"                          // field 101, 4 bytes
      "\xa3\x06\x08\x01\xa4\x06"                          // field 100, a group holding field 1
      "\xa2\x06\x00"                                  // field 100, 0 bytes
      "\x2a\x04\x0a\x02\x08\x07";                         // kv_events { stored { block_hashes: 7 } }
  bytes.append(extra, sizeof(extra) - 1);
  v1::EngineReport parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.kv_events(1).stored().block_hashes(0), 7u);
  EXPECT_EQ(where_parse_fails(*v1::EngineReport::descriptor(), bytes), "");
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

// EngineClient's registration waits for the channel (so a restarted
// scheduler is found at once): where nothing listens it names the scheduler
// when start gives up, and destroying the client cancels a registration
// still waiting (rather than sitting out its rpc_timeout).
TEST(Server, EngineClientNamesAnUnreachableSchedulerAndStopsPromptly) {
  std::string target;
  {
    SchedulerServer gone(loopback());
    target = target_of(gone);
  }  // nothing listens there now
  auto make = [&](std::chrono::milliseconds rpc_timeout) {
    EngineClientOptions o;
    o.target = target;
    o.rpc_timeout = rpc_timeout;
    o.info.set_engine_id("lost");
    o.info.set_kv_capacity_blocks(1024);
    o.info.set_block_size(16);
    o.info.set_max_batch(8);
    EngineHandlers h;
    h.on_run = [](const v1::RunRequest&) {};
    return std::make_unique<EngineClient>(o, h);
  };
  auto quick = make(std::chrono::milliseconds(200));
  try {
    quick->start(std::chrono::milliseconds(1000));
    FAIL() << "registered with nothing listening";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("could not register"), std::string::npos) << what;
    EXPECT_NE(what.find("no answer from the scheduler at " + target + " within 200 ms"), std::string::npos) << what;
  }
  auto slow = make(std::chrono::milliseconds(20000));
  EXPECT_THROW(slow->start(std::chrono::milliseconds(300)), std::runtime_error);
  const auto t0 = std::chrono::steady_clock::now();
  slow.reset();  // its registration waits up to 20 s for the channel
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
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
