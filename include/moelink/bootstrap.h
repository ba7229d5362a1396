// How the ranks of one job find each other before any GPU memory is shared.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace moelink {

// Out-of-band collective used only at setup (exchanging IPC handles, shared
// memory names). Never on the data path.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Every rank contributes `bytes` bytes; `out` receives world_size * bytes,
  // rank r's contribution at out + r * bytes. Collective: every rank calls it.
  virtual void all_gather(const void* in, void* out, size_t bytes) = 0;
  virtual void barrier();

  std::vector<char> all_gather(const std::vector<char>& in);
  // Like all_gather, but each rank may contribute a different number of
  // bytes (serialized descriptors, endpoint names); returns one blob per rank.
  std::vector<std::vector<char>> all_gather_blobs(const std::vector<char>& in);
};

// TCP rendezvous: rank 0 listens on host:port, the others connect to it.
// Throws TimeoutError naming the missing ranks when not all arrive within
// timeout_s.
std::unique_ptr<Bootstrap> make_tcp_bootstrap(int rank, int world_size, const std::string& host,
                                              int port, double timeout_s = 60.0);

// torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR (default
// 127.0.0.1), MASTER_PORT (default 29500). Throws InvalidArgument when RANK
// or WORLD_SIZE is missing or malformed.
std::unique_ptr<Bootstrap> make_env_bootstrap(double timeout_s = 60.0);

// LOCAL_RANK from the environment, else `fallback`.
int env_local_rank(int fallback);

}  // namespace moelink
