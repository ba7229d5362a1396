// The write-ahead request log: replay, torn tails, compaction, durability order.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>

#include "scheduler/core/request_log.h"
#include "scheduler_test_util.h"

namespace moelink::scheduler {
namespace {

using testing::generate_request;
using testing::TempDir;

std::vector<std::string> ids(const std::vector<RequestLog::LiveRequest>& live) {
  std::vector<std::string> out;
  for (const auto& l : live) out.push_back(l.request.request_id());
  return out;
}

TEST(RequestLog, ReplaysLiveRequestsInOrder) {
  TempDir dir;
  const std::string path = dir.file("log");
  {
    std::vector<RequestLog::LiveRequest> live;
    RequestLog log(path, &live);
    EXPECT_TRUE(live.empty());
    for (int i = 0; i < 5; ++i)
      log.append_accept(generate_request({1, 2, uint32_t(i)}, 8, "r" + std::to_string(i)), nullptr);
    log.append_started("r1");
    log.append_done("r2");
    log.append_done("r-unknown");  // harmless
    log.sync();
  }
  std::vector<RequestLog::LiveRequest> live;
  RequestLog log(path, &live);
  EXPECT_EQ(ids(live), (std::vector<std::string>{"r0", "r1", "r3", "r4"}));
  EXPECT_FALSE(live[0].started);
  EXPECT_TRUE(live[1].started);
  EXPECT_EQ(live[3].request.prompt_tokens(2), 4u);
  EXPECT_EQ(live[3].request.sampling().max_new_tokens(), 8u);
}

TEST(RequestLog, AcknowledgesOnlyAfterTheRecordIsOnDisk) {
  TempDir dir;
  const std::string path = dir.file("log");
  std::vector<RequestLog::LiveRequest> live;
  RequestLog log(path, &live);
  std::promise<uint64_t> size_at_ack;
  log.append_accept(generate_request({7, 7, 7}, 4, "durable"), [&] {
    size_at_ack.set_value(std::filesystem::file_size(path));
  });
  // When the callback runs, the record is in the file.
  EXPECT_GT(size_at_ack.get_future().get(), 12u);
}

TEST(RequestLog, StopsAtATornOrCorruptTail) {
  TempDir dir;
  const std::string path = dir.file("log");
  {
    std::vector<RequestLog::LiveRequest> live;
    RequestLog log(path, &live);
    log.append_accept(generate_request({1}, 1, "a"), nullptr);
    log.append_accept(generate_request({2}, 1, "b"), nullptr);
    log.sync();
  }
  // Tear the last record in half, as a crash mid-write would.
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 5);
  {
    std::vector<RequestLog::LiveRequest> live;
    RequestLog log(path, &live);
    EXPECT_EQ(ids(live), std::vector<std::string>{"a"});
    log.append_accept(generate_request({3}, 1, "c"), nullptr);
    log.sync();
  }
  // Flip a byte inside record "c": its checksum fails, "a" survives.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  std::vector<RequestLog::LiveRequest> live;
  RequestLog log(path, &live);
  EXPECT_EQ(ids(live), std::vector<std::string>{"a"});
}

TEST(RequestLog, RejectsAForeignFile) {
  TempDir dir;
  const std::string path = dir.file("log");
  std::ofstream(path) << "not a log\n";
  std::vector<RequestLog::LiveRequest> live;
  try {
    RequestLog log(path, &live);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a moelink request log"), std::string::npos);
  }
  EXPECT_THROW(RequestLog(dir.file("missing-dir/log"), &live), std::runtime_error);
}

TEST(RequestLog, RewritesItselfWithTheLiveSet) {
  TempDir dir;
  const std::string path = dir.file("log");
  std::vector<RequestLog::LiveRequest> live;
  {
    RequestLog log(path, &live, /*max_bytes=*/4096);
    std::vector<uint32_t> prompt(200, 5);
    for (int i = 0; i < 50; ++i) {
      const std::string id = "r" + std::to_string(i);
      log.append_accept(generate_request(prompt, 1, id), nullptr);
      if (i != 17) log.append_done(id);
      log.sync();
    }
    EXPECT_LT(log.bytes(), 8192u);  // 50 x ~1 KiB appended, rewritten down to one live request
  }
  RequestLog log(path, &live);
  EXPECT_EQ(ids(live), std::vector<std::string>{"r17"});
}

}  // namespace
}  // namespace moelink::scheduler
