#!/usr/bin/env bash
# The main job: installs what the build needs (tools/deps.sh: as root, else
# it prints the commands), builds moelink and runs moelink-bench, the
# dispatch/combine benchmark. On a machine with NVIDIA GPUs it runs the NVLink backend on every
# GPU (DeepSeek-V3 shape, 1/128/4096 tokens per rank, NCCL baselines in the
# same run); without a GPU it runs the same protocol on the CPU backend, two
# processes over shared memory, on a small shape.
# Extra arguments go to moelink-bench (see bench/README.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source tools/deps.sh
moelink_deps build
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "moelink demo: the CUDA toolkit (nvcc) is missing: moelink-bench needs it to build, even for" >&2
  echo "its CPU backend (install the CUDA toolkit, then run this again)" >&2
  exit 1
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "${MOELINK_JOBS:-$(nproc)}" --target moelink-bench
bench=build/tools/bench/moelink-bench
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ "$ngpu" -ge 1 ]]; then
  exec "$bench" --nproc "$ngpu" --tokens 1,128,4096 --graph "$@"
else
  echo "moelink demo: no GPU here, running the CPU backend (2 processes, small shape)"
  exec "$bench" --backend cpu --nproc 2 --tokens 1,16,64 --hidden 1024 --experts 16 \
    --topk 4 --scales 8 --iters 100 --warmup 5 "$@"
fi
