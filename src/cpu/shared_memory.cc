#include "cpu/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "moelink/errors.h"

namespace moelink::detail {

namespace {

// Fixed-size message through which a group leader tells its group the
// segment name (or why it could not create one), so that a failure on a
// leader fails every rank at once instead of leaving them waiting.
constexpr size_t kNameMsgBytes = 512;

[[noreturn]] void fail(const std::string& call, const std::string& name, int err) {
  throw SystemError("moelink: shared memory: " + call + "(" + name + "): " + std::strerror(err));
}

// Unmaps on scope exit unless released: the constructor must not leak a
// mapping when a later step (or a peer) fails.
struct Mapping {
  void* ptr = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (ptr != MAP_FAILED) ::munmap(ptr, bytes);
  }
  void* release() {
    void* p = ptr;
    ptr = MAP_FAILED;
    return p;
  }
};

// Unlinks the name on scope exit: whatever happens, no segment outlives setup
// under a name in /dev/shm.
struct Unlinker {
  std::string name;
  ~Unlinker() {
    if (!name.empty()) ::shm_unlink(name.c_str());
  }
};

void map_fd(int fd, const std::string& name, size_t bytes, Mapping& m) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    fail("mmap", name + ", " + std::to_string(bytes) + " bytes", err);
  }
  m.ptr = p;
  m.bytes = bytes;
  ::close(fd);  // the mapping keeps the segment alive
}

std::string unique_name() {
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/moelink-%d-%08x%08x", static_cast<int>(::getpid()), rd(), rd());
  return buf;
}

// A group leader: creates, sizes and maps a new segment; returns its name.
std::string create_segment(size_t bytes, Mapping& m, Unlinker& unlinker) {
  std::string name;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    name = unique_name();
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && (errno != EEXIST || attempt == 8)) fail("shm_open", name, errno);
  }
  unlinker.name = name;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    fail("ftruncate", name + ", " + std::to_string(bytes) + " bytes", err);
  }
  // Reserve the pages now: a full /dev/shm then fails here with a message
  // instead of killing a rank with SIGBUS in the middle of a dispatch.
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    ::close(fd);
    throw SystemError("moelink: shared memory: posix_fallocate(" + name + ", " +
                      std::to_string(bytes) + " bytes): " + std::strerror(err) +
                      " (is /dev/shm large enough? e.g. docker --shm-size)");
  }
  map_fd(fd, name, bytes, m);
  return name;
}

// Other ranks: maps the segment its leader created.
void open_segment(const std::string& name, size_t bytes, Mapping& m) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail("shm_open", name, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail("fstat", name, err);
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throw SystemError("moelink: shared memory: " + name + " has " + std::to_string(st.st_size) +
                      " bytes, expected " + std::to_string(bytes) +
                      " (do all ranks use the same config?)");
  }
  map_fd(fd, name, bytes, m);
}

// Every rank learns its group leader's message: "1<name>" on success,
// "0<error>" else.
std::string share_from_leader(Bootstrap& bs, int leader, const std::string& msg) {
  std::vector<char> blob(kNameMsgBytes, 0);
  if (bs.rank() == leader)
    std::memcpy(blob.data(), msg.data(), std::min(msg.size(), kNameMsgBytes - 1));
  std::vector<char> all = bs.all_gather(blob);
  return std::string(all.data() + static_cast<size_t>(leader) * kNameMsgBytes);  // NUL-terminated
}

}  // namespace

SharedMemory::SharedMemory(Bootstrap& bs, size_t bytes, int group_size) : size_(bytes) {
  if (bytes == 0) throw SystemError("moelink: shared memory: a segment of 0 bytes was requested");
  const int group = group_size > 0 ? group_size : bs.world_size();
  const int leader = bs.rank() / group * group;
  Mapping m;
  Unlinker unlinker;
  std::string leader_error;
  if (bs.rank() == leader) {
    try {
      name_ = create_segment(bytes, m, unlinker);
    } catch (const SystemError& e) {
      leader_error = e.what();
    }
  }
  const std::string msg =
      share_from_leader(bs, leader, leader_error.empty() ? "1" + name_ : "0" + leader_error);
  if (!leader_error.empty()) throw SystemError(leader_error);
  if (msg.empty() || msg[0] != '1')
    throw SystemError("moelink: shared memory: rank " + std::to_string(leader) +
                      " failed to create the segment: " +
                      (msg.empty() ? std::string("(no message)") : msg.substr(1)));

  std::string my_error;
  if (bs.rank() != leader) {
    name_ = msg.substr(1);
    try {
      open_segment(name_, bytes, m);
    } catch (const SystemError& e) {
      my_error = e.what();
    }
  }
  // Every rank reports whether it mapped its segment; after this exchange
  // nobody needs the names any more, so the leaders' Unlinkers remove them.
  std::vector<char> ok = bs.all_gather(std::vector<char>{my_error.empty() ? '1' : '0'});
  if (!my_error.empty()) throw SystemError(my_error);
  for (int r = 0; r < bs.world_size(); ++r)
    if (ok[static_cast<size_t>(r)] != '1')
      throw SystemError("moelink: shared memory: rank " + std::to_string(r) +
                        " could not map its segment (see that rank's error)");
  data_ = m.release();
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

}  // namespace moelink::detail
