// One device buffer per rank, mapped into every other rank of its node
// through CUDA IPC, so kernels can store straight into peers' memory.
#pragma once

#include <cstddef>
#include <vector>

#include "moelink/bootstrap.h"

namespace moelink::detail {

class PeerMemory {
 public:
  // Collective: allocates `bytes` (zeroed) on the current device, exchanges
  // IPC handles through `bootstrap` and opens the buffer of every peer in
  // this rank's node: `node_size` consecutive ranks (0: all ranks). Returns
  // after every rank has zeroed its buffer.
  PeerMemory(size_t bytes, Bootstrap& bootstrap, int node_size = 0);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  size_t bytes() const { return bytes_; }
  char* local() const { return bases_[rank_]; }
  // Base address of every rank's buffer in this process (own included;
  // null outside this rank's node).
  const std::vector<char*>& bases() const { return bases_; }

 private:
  size_t bytes_;
  int rank_;
  std::vector<char*> bases_;
};

}  // namespace moelink::detail
