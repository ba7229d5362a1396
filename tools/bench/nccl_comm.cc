#include "nccl_comm.h"

#include <cstdlib>
#include <vector>

#include "cuda_check.h"

namespace moelink_bench {

NcclComm::NcclComm(moelink::Bootstrap& b) : rank_(b.rank()), world_(b.world_size()) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  ncclUniqueId id{};
  if (rank_ == 0) BENCH_NCCL(ncclGetUniqueId(&id));
  std::vector<ncclUniqueId> all(world_);
  b.all_gather(&id, all.data(), sizeof(id));
  BENCH_NCCL(ncclCommInitRank(&comm_, world_, all[0], rank_));
}

NcclComm::~NcclComm() {
  if (comm_) ncclCommDestroy(comm_);
}

}  // namespace moelink_bench
