#include "scheduler/core/request_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace moelink::scheduler {
namespace {

constexpr char kMagic[] = "MOELINKLOG1\n";
constexpr size_t kMagicSize = sizeof(kMagic) - 1;
constexpr uint32_t kMaxRecord = 64u << 20;

std::runtime_error sys_error(const std::string& what, const std::string& path) {
  return std::runtime_error("request log " + path + ": " + what + ": " + std::strerror(errno));
}

void write_all(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw sys_error("write", path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

void RequestLog::encode(std::string& out, RecordType type, const std::string& payload) {
  const char t = static_cast<char>(type);
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(&t), 1);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(payload.data()), static_cast<uInt>(payload.size()));
  put_u32(out, static_cast<uint32_t>(payload.size()));
  put_u32(out, static_cast<uint32_t>(crc));
  out.push_back(t);
  out += payload;
}

RequestLog::RequestLog(const std::string& path, std::vector<LiveRequest>* live, uint64_t max_bytes)
    : path_(path), max_bytes_(max_bytes) {
  replay(live);
  rewrite_live();
  thread_ = std::thread([this] { flusher(); });
}

RequestLog::~RequestLog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

void RequestLog::replay(std::vector<LiveRequest>* live) {
  std::string data;
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) throw sys_error("open", path_);
  } else {
    char buf[1 << 16];
    for (;;) {
      const ssize_t r = ::read(fd, buf, sizeof(buf));
      if (r < 0) {
        if (errno == EINTR) continue;
        ::close(fd);
        throw sys_error("read", path_);
      }
      if (r == 0) break;
      data.append(buf, static_cast<size_t>(r));
    }
    ::close(fd);
  }
  if (!data.empty() && data.compare(0, kMagicSize, kMagic) != 0)
    throw std::runtime_error("request log " + path_ + ": not a moelink request log (bad header)");
  size_t pos = data.empty() ? 0 : kMagicSize;
  while (pos + 9 <= data.size()) {
    const uint32_t size = get_u32(data.data() + pos);
    const uint32_t crc = get_u32(data.data() + pos + 4);
    if (size > kMaxRecord || pos + 9 + size > data.size()) break;  // torn tail
    const char type = data[pos + 8];
    uLong c = crc32(0L, reinterpret_cast<const Bytef*>(&type), 1);
    c = crc32(c, reinterpret_cast<const Bytef*>(data.data() + pos + 9), size);
    if (static_cast<uint32_t>(c) != crc) break;  // corrupt tail
    std::string payload = data.substr(pos + 9, size);
    pos += 9 + size;
    switch (static_cast<RecordType>(type)) {
      case kAccept: {
        v1::GenerateRequest r;
        if (!r.ParseFromString(payload) || r.request_id().empty()) break;
        Live& l = live_[r.request_id()];
        l.accept_payload = std::move(payload);
        l.order = next_order_++;
        break;
      }
      case kStarted: {
        auto it = live_.find(payload);
        if (it != live_.end()) it->second.started = true;
        break;
      }
      case kDone:
        live_.erase(payload);
        break;
      default:
        break;
    }
  }
  if (live) {
    std::vector<std::pair<uint64_t, const Live*>> ordered;
    for (const auto& [id, l] : live_) ordered.push_back({l.order, &l});
    std::sort(ordered.begin(), ordered.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [order, l] : ordered) {
      LiveRequest r;
      r.request.ParseFromString(l->accept_payload);
      r.started = l->started;
      live->push_back(std::move(r));
    }
  }
}

void RequestLog::rewrite_live() {
  // Write the live set to a new file, sync it, and rename it over the log:
  // a crash leaves either the old log or the new one.
  std::vector<std::pair<uint64_t, std::pair<const std::string*, const Live*>>> ordered;
  std::string out(kMagic, kMagicSize);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, l] : live_) ordered.push_back({l.order, {&id, &l}});
    std::sort(ordered.begin(), ordered.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [order, p] : ordered) {
      encode(out, kAccept, p.second->accept_payload);
      if (p.second->started) encode(out, kStarted, *p.first);
    }
  }
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw sys_error("create", tmp);
  write_all(fd, out.data(), out.size(), tmp);
  if (::fdatasync(fd) != 0) throw sys_error("fdatasync", tmp);
  ::close(fd);
  if (::rename(tmp.c_str(), path_.c_str()) != 0) throw sys_error("rename", tmp);
  const int new_fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (new_fd < 0) throw sys_error("open", path_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = new_fd;
  file_bytes_ = out.size();
}

void RequestLog::append(RecordType type, const std::string& payload,
                        std::function<void()> on_durable) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    encode(pending_, type, payload);
    callbacks_.push_back(std::move(on_durable));
    ++appended_;
  }
  cv_.notify_one();
}

void RequestLog::append_accept(const v1::GenerateRequest& request, std::function<void()> on_durable) {
  std::string payload = request.SerializeAsString();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Live& l = live_[request.request_id()];
    l.accept_payload = payload;
    l.order = next_order_++;
  }
  append(kAccept, payload, std::move(on_durable));
}

void RequestLog::append_started(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(request_id);
    if (it == live_.end()) return;
    it->second.started = true;
  }
  append(kStarted, request_id, nullptr);
}

void RequestLog::append_done(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(request_id) == 0) return;
  }
  append(kDone, request_id, nullptr);
}

void RequestLog::sync() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = appended_;
  durable_cv_.wait(lock, [&] { return durable_ >= target; });
}

uint64_t RequestLog::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return file_bytes_ + pending_.size();
}

void RequestLog::flusher() {
  try {
    flush_loop();
  } catch (const std::exception& e) {
    // Acknowledging requests that are not on disk would break the log's
    // promise: stop the process instead, saying why.
    std::fprintf(stderr, "moelink-scheduler: %s; stopping\n", e.what());
    std::abort();
  }
}

void RequestLog::flush_loop() {
  std::string batch;
  std::vector<std::function<void()>> callbacks;
  for (;;) {
    uint64_t count;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty() && stop_) return;
      batch.swap(pending_);
      callbacks.swap(callbacks_);
      count = appended_;
    }
    write_all(fd_, batch.data(), batch.size(), path_);
    if (::fdatasync(fd_) != 0) throw sys_error("fdatasync", path_);
    file_bytes_ += batch.size();
    batch.clear();
    for (auto& cb : callbacks)
      if (cb) cb();
    callbacks.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      durable_ = count;
    }
    durable_cv_.notify_all();
    if (file_bytes_ > max_bytes_) rewrite_live();
  }
}

}  // namespace moelink::scheduler
