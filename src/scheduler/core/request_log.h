// The scheduler's write-ahead log of accepted requests (--request-log PATH).
//
// A request is acknowledged to its client (the Accepted event) only after
// its record is on disk (write + fdatasync, batched: every record appended
// while one sync runs goes out with the next). Started and done records
// follow without waiting. After a restart the scheduler replays the log: a
// request accepted and not done is live again; engines that register with
// it in `held` keep it, the others are re-routed (or, if the log says it had
// started, failed with UNAVAILABLE, so no request runs twice).
//
// File: "MOELINKLOG1\n", then records [u32 size][u32 crc32][u8 type][payload]
// (little-endian; crc over type and payload). A torn or corrupt tail (a
// crash mid-write) ends the replay there. The log rewrites itself with only
// the live requests when opened and whenever it grows past max_bytes.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "moelink/scheduler/v1/scheduler.pb.h"

namespace moelink::scheduler {

class RequestLog {
 public:
  struct LiveRequest {
    v1::GenerateRequest request;  // request_id set
    bool started = false;
  };
  // Opens or creates the log at `path`, returns the live requests it holds
  // (in acceptance order) in `live`. Throws std::runtime_error naming the
  // path and the system error when the file cannot be used.
  RequestLog(const std::string& path, std::vector<LiveRequest>* live,
             uint64_t max_bytes = 256ull << 20);
  ~RequestLog();
  RequestLog(const RequestLog&) = delete;
  RequestLog& operator=(const RequestLog&) = delete;

  // on_durable runs on the log's thread once the record is on disk.
  void append_accept(const v1::GenerateRequest& request, std::function<void()> on_durable);
  void append_started(const std::string& request_id);
  void append_done(const std::string& request_id);
  // Returns once everything appended before the call is on disk.
  void sync();

  const std::string& path() const { return path_; }
  uint64_t bytes() const;

 private:
  enum RecordType : uint8_t { kAccept = 1, kStarted = 2, kDone = 3 };
  void append(RecordType type, const std::string& payload, std::function<void()> on_durable);
  void replay(std::vector<LiveRequest>* live);
  void rewrite_live();  // caller holds no lock; only the flusher thread or the constructor
  void flusher();
  void flush_loop();
  static void encode(std::string& out, RecordType type, const std::string& payload);

  std::string path_;
  uint64_t max_bytes_;
  int fd_ = -1;
  std::atomic<uint64_t> file_bytes_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string pending_;                           // encoded records not yet written
  std::vector<std::function<void()>> callbacks_;  // for the records in pending_
  uint64_t appended_ = 0, durable_ = 0;           // record counts
  bool stop_ = false;
  std::condition_variable durable_cv_;

  // The live set, kept here so the log can rewrite itself: id -> record.
  struct Live {
    std::string accept_payload;
    bool started = false;
    uint64_t order = 0;
  };
  std::unordered_map<std::string, Live> live_;
  uint64_t next_order_ = 0;

  std::thread thread_;
};

}  // namespace moelink::scheduler
