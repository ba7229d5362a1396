#include "fabric_test_util.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>

namespace moelink_test {

using namespace moelink::fabric;

bool fabric_provider_available(const std::string& provider) {
  static std::map<std::string, bool> cache;
  auto it = cache.find(provider);
  if (it != cache.end()) return it->second;
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    bool ok = false;
    try {
      ok = provider_available(provider);
    } catch (...) {
    }
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return cache[provider] = false;
  return cache[provider] = WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::unique_ptr<TransferEngine> make_engine(const std::string& provider, int rank, int num_domains,
                                            double timeout_s) {
  EngineOptions o;
  o.provider = provider;
  o.name = "rank" + std::to_string(rank);
  o.num_domains = num_domains;
  o.timeout_s = timeout_s;
  o.yield_when_idle = true;
  o.recv_buffers = 16;
  return TransferEngine::create(o);
}

std::vector<MemoryDescriptor> exchange_descriptors(moelink::Bootstrap& b, TransferEngine& e,
                                                   const MemoryRegion& region) {
  std::vector<MemoryDescriptor> out;
  for (const auto& blob : b.all_gather_blobs(e.descriptor(region).serialize()))
    out.push_back(MemoryDescriptor::deserialize(blob.data(), blob.size()));
  return out;
}

}  // namespace moelink_test
