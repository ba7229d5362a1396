// A POSIX shared memory segment mapped by every rank of a Bootstrap: the
// peer-visible memory of the CPU backend.
#pragma once

#include <cstddef>
#include <string>

#include "moelink/bootstrap.h"

namespace moelink::detail {

class SharedMemory {
 public:
  // Collective over all ranks of `bootstrap`. The ranks form groups of
  // `group_size` consecutive ranks (0: one group of all); each group's first
  // rank creates a uniquely named segment of `bytes` zero-filled bytes and
  // the group maps it; once all have, the creators unlink the names, so the
  // memory goes away with the last mapping even if a process dies. Throws
  // SystemError (naming the call, the segment and the reason) on every rank
  // when any rank fails.
  SharedMemory(Bootstrap& bootstrap, size_t bytes, int group_size = 0);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // The segment's name while it existed (for messages).
  const std::string& name() const { return name_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
};

}  // namespace moelink::detail
