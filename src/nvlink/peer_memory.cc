#include "nvlink/peer_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "nvlink/cuda_check.h"
#include "nvlink/cuda_release.h"

namespace moelink::detail {

PeerMemory::PeerMemory(size_t bytes, Bootstrap& bootstrap, int node_size)
    : bytes_(bytes), rank_(bootstrap.rank()), bases_(bootstrap.world_size(), nullptr) {
  const int world = bootstrap.world_size();
  const int node = node_size > 0 ? node_size : world;
  const int first = rank_ / node * node, last = std::min(world, first + node);
  void* mem = nullptr;
  MOELINK_CUDA_CHECK(cudaMalloc(&mem, bytes));
  bases_[rank_] = static_cast<char*>(mem);
  MOELINK_CUDA_CHECK(cudaMemset(mem, 0, bytes));
  MOELINK_CUDA_CHECK(cudaDeviceSynchronize());

  cudaIpcMemHandle_t mine;
  MOELINK_CUDA_CHECK(cudaIpcGetMemHandle(&mine, mem));
  std::vector<cudaIpcMemHandle_t> all(world);
  bootstrap.all_gather(&mine, all.data(), sizeof(cudaIpcMemHandle_t));
  for (int r = first; r < last; ++r) {
    if (r == rank_) continue;
    void* p = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&p, all[r], cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      for (int q = first; q < r; ++q)
        if (q != rank_ && bases_[q]) cudaIpcCloseMemHandle(bases_[q]);
      cudaFree(mem);
      throw SystemError("moelink: rank " + std::to_string(rank_) +
                        ": cannot map the buffer of rank " + std::to_string(r) +
                        " (cudaIpcOpenMemHandle: " + cudaGetErrorString(err) +
                        "); the ranks of a node must be GPUs of one host with peer access "
                        "(for the internode backend, Options.node_size = 1 sends every peer "
                        "through the NIC)");
    }
    bases_[r] = static_cast<char*>(p);
  }
  // Nobody may write into a peer before that peer has zeroed its buffer.
  bootstrap.barrier();
}

PeerMemory::~PeerMemory() {
  RelaxedCaptureMode relaxed;  // an AllToAll may go while someone else captures
  for (size_t r = 0; r < bases_.size(); ++r) {
    if (static_cast<int>(r) == rank_ || bases_[r] == nullptr) continue;
    cudaIpcCloseMemHandle(bases_[r]);
  }
  release_device_memory(bases_[rank_]);
}

}  // namespace moelink::detail
