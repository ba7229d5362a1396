// Programmatic dependent launch (PDL) of the expert kernels. A forward() is
// five to seven kernels, each a few to a few tens of microseconds at decode;
// launched in plain stream order, every boundary leaves the GPU waiting for
// the last block of one kernel to retire before the next kernel's blocks are
// even created. Launched with PDL, the next kernel's blocks are created while
// the current one runs and wait on the device (griddepcontrol.wait) for its
// completion, so a boundary costs only that wait.
//
// The rule that keeps this as safe as stream order: every kernel launched
// with PDL calls begin_programmatic_kernel() before it touches global memory.
// The wait returns once the kernel before it on the stream has completed and
// its writes are visible, and that kernel waited for the one before it, and so
// on; so each kernel still sees all earlier kernels' writes, and no earlier
// kernel still reads memory it overwrites (the GEMMs share argument arrays).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "nvlink/cuda_check.h"

namespace moelink::detail::experts {

// Waits for the previous kernel on the stream (no-op when this kernel was not
// launched with PDL, or that kernel has finished), then lets the next one
// launch. The trigger comes after the wait so that at most one kernel ahead
// has blocks waiting: the one after waits only for this one.
__device__ __forceinline__ void begin_programmatic_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL when
// `programmatic` (the kernel must begin with begin_programmatic_kernel()).
template <class... Params, class... Args>
void launch_expert_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  MOELINK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace moelink::detail::experts
