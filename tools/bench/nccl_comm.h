// The NCCL communicator of the baselines, one rank per bootstrap rank.
#pragma once

#include <nccl.h>

#include "moelink/bootstrap.h"

namespace moelink_bench {

class NcclComm {
 public:
  // Collective. Rank 0's ncclUniqueId travels through the bootstrap's
  // all_gather. NVLink SHARP / multicast (NVLS) is switched off first: the
  // baseline is point-to-point send/recv, and multicast must stay off.
  explicit NcclComm(moelink::Bootstrap& b);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ncclComm_t get() const { return comm_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, world_ = 1;
};

}  // namespace moelink_bench
