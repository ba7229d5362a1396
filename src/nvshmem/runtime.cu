// The process-wide NVSHMEM runtime (runtime.h): start-up through the unique
// id, environment defaults, the symmetric buffer pool.
#include "nvshmem/runtime.h"

#include <cuda_runtime_api.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "moelink/errors.h"
#include "nvlink/cuda_check.h"

namespace moelink::detail::shmem {
namespace {

struct Block {
  char* base;
  size_t bytes;
  int64_t id;  // allocation sequence number: the same on every rank
  bool in_use;
};

struct Runtime {
  std::mutex mu;
  bool initialized = false;
  int rank = -1, world = 0, device = -1;
  std::vector<Block> pool;
  int64_t next_id = 0;
};

Runtime& runtime() {
  static Runtime* r = new Runtime;  // never destroyed: NVSHMEM outlives static destructors
  return *r;
}

void set_default(const char* name, const char* value) { setenv(name, value, /*overwrite=*/0); }

// True when every rank runs on this host (hostnames compared).
bool single_host(Bootstrap& b) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::vector<char> all(sizeof(name) * b.world_size());
  b.all_gather(name, all.data(), sizeof(name));
  for (int r = 0; r < b.world_size(); ++r)
    if (std::strncmp(&all[r * sizeof(name)], name, sizeof(name)) != 0) return false;
  return true;
}

void initialize(Runtime& rt, Bootstrap& b, int device) {
  // NVLink multicast (NVLS) can take a host's GPUs out of service: never on.
  set_default("NVSHMEM_DISABLE_NVLS", "1");
  // moelink uses point-to-point puts and signals only; NCCL-backed NVSHMEM
  // collectives would also make the benchmark's dense baseline NCCL's.
  set_default("NVSHMEM_DISABLE_NCCL", "1");
  if (single_host(b)) {
    // All peers are reachable by P2P; the unique-id rendezvous stays on
    // loopback and no network transport is probed. Set either variable to
    // run otherwise (docs/nvshmem.md).
    set_default("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo");
    set_default("NVSHMEM_REMOTE_TRANSPORT", "none");
  }
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (b.rank() == 0 && nvshmemx_get_uniqueid(&id) != 0)
    throw SystemError("moelink: nvshmemx_get_uniqueid failed on rank 0 (NVSHMEM_DEBUG=WARN "
                      "says why; NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME picks the interface)");
  std::vector<char> ids(sizeof(id) * b.world_size());
  b.all_gather(&id, ids.data(), sizeof(id));
  std::memcpy(&id, ids.data(), sizeof(id));  // rank 0's

  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(b.rank(), b.world_size(), &id, &attr) != 0)
    throw SystemError("moelink: nvshmemx_set_attr_uniqueid_args(rank " +
                      std::to_string(b.rank()) + ", world " + std::to_string(b.world_size()) +
                      ") failed");
  // nvshmemx_init_attr exits the process on failure; the call it wraps
  // reports the status instead.
  nvshmemx_init_init_attr_ver_only(attr);
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  const int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                          NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0)
    throw SystemError("moelink: NVSHMEM initialization failed on rank " +
                      std::to_string(b.rank()) + " (status " + std::to_string(status) +
                      "); run with NVSHMEM_DEBUG=INFO for the reason");
  if (nvshmem_my_pe() != b.rank() || nvshmem_n_pes() != b.world_size())
    throw SystemError("moelink: NVSHMEM started as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                      std::to_string(nvshmem_n_pes()) + " but the bootstrap says rank " +
                      std::to_string(b.rank()) + " of " + std::to_string(b.world_size()));
  rt.initialized = true;
  rt.rank = b.rank();
  rt.world = b.world_size();
  rt.device = device;
}

}  // namespace

void ensure_initialized(Bootstrap& b) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  int device = -1;
  MOELINK_CUDA_CHECK(cudaGetDevice(&device));
  if (!rt.initialized) {
    // Someone else (e.g. torch) may have started NVSHMEM in this process
    // already: share it when it is the same job. The init call (no
    // bootstrap arguments, reference counted by NVSHMEM) still registers
    // this library's device-side state, which NVSHMEM keeps per module.
    if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
      int provided = 0;
      const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION,
                                          NVSHMEM_VENDOR_MINOR_VERSION,
                                          NVSHMEM_VENDOR_PATCH_VERSION};
      if (nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version) != 0)
        throw SystemError("moelink: NVSHMEM was started by someone else in this process, and "
                          "registering moelink's kernels with it failed");
      rt.initialized = true;
      rt.rank = nvshmem_my_pe();
      rt.world = nvshmem_n_pes();
      rt.device = device;
    } else {
      initialize(rt, b, device);
      return;
    }
  }
  if (rt.rank != b.rank() || rt.world != b.world_size())
    throw InvalidArgument("moelink: NVSHMEM already runs in this process as PE " +
                          std::to_string(rt.rank) + " of " + std::to_string(rt.world) +
                          "; backend \"nvshmem\" cannot join rank " + std::to_string(b.rank()) +
                          " of " + std::to_string(b.world_size()) +
                          " (NVSHMEM allows one job per process)");
  if (rt.device != device)
    throw InvalidArgument("moelink: NVSHMEM runs on CUDA device " + std::to_string(rt.device) +
                          " in this process, but the current device is " +
                          std::to_string(device) + "; use one device per process");
}

char* symmetric_acquire(size_t bytes, Bootstrap& b) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  // The smallest free buffer that fits; reused only when every rank picks
  // the same one (nvshmem_malloc is collective, so all ranks must agree).
  int64_t mine = -1;
  size_t best = SIZE_MAX;
  for (const Block& blk : rt.pool)
    if (!blk.in_use && blk.bytes >= bytes && blk.bytes < best) {
      best = blk.bytes;
      mine = blk.id;
    }
  std::vector<int64_t> picks(b.world_size());
  b.all_gather(&mine, picks.data(), sizeof(mine));
  bool agree = mine >= 0;
  for (int64_t p : picks) agree = agree && p == mine;
  Block* chosen = nullptr;
  if (agree) {
    for (Block& blk : rt.pool)
      if (blk.id == mine) chosen = &blk;
  } else {
    void* p = nvshmem_malloc(bytes);
    if (p == nullptr)
      throw SystemError("moelink: nvshmem_malloc(" + std::to_string(bytes) +
                        " bytes) failed on rank " + std::to_string(b.rank()) +
                        " (symmetric heap: NVSHMEM_SYMMETRIC_SIZE, NVSHMEM_MAX_MEMORY_PER_GPU)");
    rt.pool.push_back(Block{static_cast<char*>(p), bytes, rt.next_id++, false});
    chosen = &rt.pool.back();
  }
  chosen->in_use = true;
  MOELINK_CUDA_CHECK(cudaMemset(chosen->base, 0, chosen->bytes));
  MOELINK_CUDA_CHECK(cudaDeviceSynchronize());
  // No rank signals into a buffer before its owner has zeroed it.
  b.barrier();
  return chosen->base;
}

void symmetric_release(char* base) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  for (Block& blk : rt.pool)
    if (blk.base == base) blk.in_use = false;
}

void dense_alltoall(char* dst, const char* src, size_t bytes_per_pe, cudaStream_t stream) {
  const int status = nvshmemx_alltoallmem_on_stream(NVSHMEM_TEAM_WORLD, dst, src, bytes_per_pe, stream);
  if (status != 0)
    throw SystemError("moelink: nvshmemx_alltoallmem_on_stream(" + std::to_string(bytes_per_pe) +
                      " bytes per PE) failed with status " + std::to_string(status));
}

}  // namespace moelink::detail::shmem
