// NVSHMEM as a process-wide runtime: initialized once per process from a
// moelink Bootstrap (unique-id path, no MPI), symmetric buffers pooled so
// that an AllToAll can be destroyed without a collective call. Plain C++:
// callers need no NVSHMEM headers.
//
// NVSHMEM allows one job per process, so every AllToAll (and the benchmark's
// dense baseline) of a process shares the PE set of the first bootstrap.
// It is never finalized: nvshmem_finalize is collective, and a rank that
// returns after a peer died (a timeout) must not block in it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "moelink/bootstrap.h"

namespace moelink::detail::shmem {

// Collective on the first call of the process: sets NVSHMEM defaults that
// are unset (NVSHMEM_DISABLE_NVLS=1 always; NVSHMEM_DISABLE_NCCL=1; on one
// host NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo and NVSHMEM_REMOTE_TRANSPORT=none),
// then rank 0's unique id reaches every rank through `bootstrap` and NVSHMEM
// starts on the current CUDA device. Later calls check that rank, world
// size and device match. Throws InvalidArgument / SystemError naming what
// differs or failed.
void ensure_initialized(Bootstrap& bootstrap);

// Collective (every rank, same bytes, same order): a zero-filled symmetric
// buffer of at least `bytes`, reused from the pool when every rank has the
// same free one, else nvshmem_malloc. All ranks have zeroed it on return.
char* symmetric_acquire(size_t bytes, Bootstrap& bootstrap);
// Local, never collective: the buffer goes back to the pool. The caller has
// synchronized the work that used it.
void symmetric_release(char* base);

// NVSHMEM's own dense all-to-all (nvshmemx_alltoallmem_on_stream over every
// PE): block r of `src` (bytes_per_pe each) lands in block `my PE` of `dst`
// on PE r. Both are symmetric buffers from symmetric_acquire. For the
// benchmark's baseline; collective. NVSHMEM refuses it (exits) when several
// PEs share a GPU without MPS: callers check first.
void dense_alltoall(char* dst, const char* src, size_t bytes_per_pe, cudaStream_t stream);

}  // namespace moelink::detail::shmem
