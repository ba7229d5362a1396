#include "internode/node_size.h"

#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moelink/errors.h"

namespace moelink::detail::internode {

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// The host-name blocks: n when ranks [b*n, (b+1)*n) share a name for every
// block b and neighbouring blocks differ, else 0.
int uniform_blocks(const std::vector<std::string>& hosts) {
  const int w = static_cast<int>(hosts.size());
  int n = 1;
  while (n < w && hosts[n] == hosts[0]) ++n;
  if (w % n != 0) return 0;
  for (int r = 0; r < w; ++r) {
    const int leader = r / n * n;
    if (hosts[r] != hosts[leader]) return 0;
    if (r == leader && r > 0 && hosts[r] == hosts[r - 1]) return 0;
  }
  return n;
}

}  // namespace

int resolve_node_size(const Config& c, int requested, Bootstrap& bootstrap) {
  const int w = c.world_size;
  int n = requested;
  if (n > 0) {
    if (w % n != 0)
      throw InvalidArgument("moelink: Options.node_size = " + std::to_string(n) +
                            " must divide world_size = " + std::to_string(w) +
                            " (1 = every peer through the NIC, 0 = by host name)");
  } else {
    std::vector<std::string> hosts;
    for (const auto& blob : bootstrap.all_gather_blobs(
             [] {
               const std::string h = host_name();
               return std::vector<char>(h.begin(), h.end());
             }()))
      hosts.emplace_back(blob.begin(), blob.end());
    n = uniform_blocks(hosts);
    if (n == 0) n = 1;
  }
  // An environment variable set differently on some rank would make the
  // ranks disagree on every offset: refuse it here rather than corrupt.
  const std::vector<char> all =
      bootstrap.all_gather(std::vector<char>(reinterpret_cast<const char*>(&n),
                                             reinterpret_cast<const char*>(&n) + sizeof(n)));
  for (int r = 0; r < w; ++r) {
    int other = 0;
    std::copy(all.begin() + r * sizeof(int), all.begin() + (r + 1) * sizeof(int),
              reinterpret_cast<char*>(&other));
    if (other != n)
      throw InvalidArgument("moelink: Options.node_size resolved to " + std::to_string(n) +
                            " on rank " + std::to_string(c.rank) + " but to " +
                            std::to_string(other) + " on rank " + std::to_string(r) +
                            "; set Options.node_size (or MOELINK_NODE_SIZE) the same on every "
                            "rank");
  }
  return n;
}

}  // namespace moelink::detail::internode
