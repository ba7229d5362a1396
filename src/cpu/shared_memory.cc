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

// Fixed-size message through which rank 0 tells the others the segment name
// (or why it could not create one), so that a failure on rank 0 fails every
// rank at once instead of leaving them waiting.
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

// Rank 0: creates, sizes and maps a new segment; returns its name.
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

// Other ranks: maps the segment rank 0 created.
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

// Every rank learns rank 0's message: "1<name>" on success, "0<error>" else.
std::string share_from_root(Bootstrap& bs, const std::string& msg) {
  std::vector<char> blob(kNameMsgBytes, 0);
  if (bs.rank() == 0) std::memcpy(blob.data(), msg.data(), std::min(msg.size(), kNameMsgBytes - 1));
  std::vector<char> all = bs.all_gather(blob);
  return std::string(all.data());  // rank 0's part, NUL-terminated
}

}  // namespace

SharedMemory::SharedMemory(Bootstrap& bs, size_t bytes) : size_(bytes) {
  if (bytes == 0) throw SystemError("moelink: shared memory: a segment of 0 bytes was requested");
  Mapping m;
  Unlinker unlinker;
  std::string root_error;
  if (bs.rank() == 0) {
    try {
      name_ = create_segment(bytes, m, unlinker);
    } catch (const SystemError& e) {
      root_error = e.what();
    }
  }
  const std::string msg = share_from_root(bs, root_error.empty() ? "1" + name_ : "0" + root_error);
  if (!root_error.empty()) throw SystemError(root_error);
  if (msg.empty() || msg[0] != '1')
    throw SystemError("moelink: shared memory: rank 0 failed to create the segment: " +
                      (msg.empty() ? std::string("(no message)") : msg.substr(1)));

  std::string my_error;
  if (bs.rank() != 0) {
    name_ = msg.substr(1);
    try {
      open_segment(name_, bytes, m);
    } catch (const SystemError& e) {
      my_error = e.what();
    }
  }
  // Every rank reports whether it mapped the segment; after this exchange
  // nobody needs the name any more, so rank 0's Unlinker removes it.
  std::vector<char> ok = bs.all_gather(std::vector<char>{my_error.empty() ? '1' : '0'});
  if (!my_error.empty()) throw SystemError(my_error);
  for (int r = 0; r < bs.world_size(); ++r)
    if (ok[static_cast<size_t>(r)] != '1')
      throw SystemError("moelink: shared memory: rank " + std::to_string(r) + " could not map " +
                        name_ + " (see that rank's error)");
  data_ = m.release();
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

}  // namespace moelink::detail
