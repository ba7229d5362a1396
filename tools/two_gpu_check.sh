#!/usr/bin/env bash
# The two-GPU evidence (nvidia-h200-x2: the backends over NVLink P2P between
# two GPUs, the core's latency targets, the layer at world 2), in three
# device calls of at most 10 minutes that must follow each
# other while the machine is warm (build-gpu/ is kept only then):
#
#   bash tools/two_gpu_check.sh build nvshmem internode   # call 1
#   bash tools/two_gpu_check.sh core layer                # call 2
#   bash tools/two_gpu_check.sh sanitize                  # call 3
#
#   build      everything (CUDA, NVSHMEM, libfabric, Python module)
#   nvshmem    the NVSHMEM backend's GPU suite over NVLink P2P, and the
#              side-by-side benchmark (nvshmem, nvlink, NCCL's full path,
#              NVSHMEM's dense all-to-all) at 1, 128 and 4096 tokens
#   internode  the internode backend with the GPUs as nodes (node_size 1,
#              libfabric shm, host staging): its tests, then moelink-bench's
#              per-phase latency beside nvlink; then node_size 2 (the NVLink
#              hop inside the internode backend), tests and latency
#   core       the NVLink core at DeepSeek-V3's shape, CUDA graphs and split
#              phases, 1 / 128 / 4096 tokens (targets: <= 30 us at 128, <= 15
#              us at 1, <= 1.5x the floor at 4096), and Nsight Compute's
#              summary of its kernels at 128 tokens when ncu is there
#   layer      the MoE layer at world 2: batches 8, 32, 64, 128, every mode,
#              eager and graphs (layer_bench.py --world 2)
#   sanitize   compute-sanitizer memcheck and racecheck on the two-GPU runs
#              (the GPU suite's small cases, the layer at world 2)
# JSON and logs go to $OUT; the commit comes from MOELINK_GIT_COMMIT.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
steps=${*:-build nvshmem internode}
source "$root/tools/device_env.sh"
(( ngpu >= 2 )) || echo "two_gpu_check: only $ngpu GPU(s) here; ranks share GPUs (times are not meaningful)"
bench=build-gpu/tools/bench/moelink-bench
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s]"; }

if has build; then
  MOELINK_CMAKE_ARGS="-DMOELINK_BUILD_PYTHON=ON ${MOELINK_CMAKE_ARGS:-}" bash tools/gpu_check.sh build || exit 1
  elapsed
fi
if has nvshmem; then
  MOELINK_BENCH_NPROC=2 bash tools/nvshmem_check.sh test bench || status=1
  elapsed
fi
if has internode; then
  echo "== internode tests"
  FI_TCP_IFACE=lo build-gpu/src/fabric/tests/moelink_internode_tests >"$OUT/internode-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED" "$OUT/internode-tests.log" | tail -20
  for ns in 1 2; do
    # gpu_check.sh's internode step (moelink-bench beside nvlink, libfabric
    # shm), its JSON and log under $OUT/node-size-$ns; node_size 2: two
    # "nodes" of two ranks (ranks share the GPUs).
    MOELINK_BENCH_NPROC=$(( ns == 1 ? 2 : 4 )) OUT="$OUT/node-size-$ns" \
      MOELINK_INTERNODE_BENCH_ARGS="--node-size $ns --tokens 1,128,4096 --split" \
      timeout 240 bash tools/gpu_check.sh internode || status=1
  done
  elapsed
fi
if has core; then
  echo "== moelink-bench nvlink, DeepSeek-V3 shape, graphs and split phases"
  cmd=($bench --nproc "$ngpu" --backend nvlink --tokens 1,128,4096 --graph --split --iters 1000
       --warmup 50 --machine "nvidia-h200-x$ngpu" --json "$OUT/bench-core.json")
  echo "${cmd[*]}"
  timeout 300 "${cmd[@]}" >"$OUT/bench-core.log" 2>&1 || status=1
  tail -30 "$OUT/bench-core.log"
  if command -v ncu >/dev/null; then
    echo "== ncu: the NVLink kernels at 128 tokens (rank 0)"
    timeout 200 ncu --target-processes all --kernel-name regex:"dispatch|combine" --launch-count 8 \
      --section SpeedOfLight --section LaunchStats --csv \
      $bench --nproc "$ngpu" --backend nvlink --tokens 128 --iters 4 --warmup 1 --no-nccl --no-dense \
      >"$OUT/ncu-core.csv" 2>"$OUT/ncu-core.log" || status=1
    tail -3 "$OUT/ncu-core.log"
  fi
  elapsed
fi
if has layer; then
  # gpu_check.sh's layer step at world $ngpu; its layer.json under $OUT/layer-world-$ngpu.
  OUT="$OUT/layer-world-$ngpu" MOELINK_LAYER_BENCH_ARGS="--world $ngpu --batches 8,32,64,128" \
    timeout 300 bash tools/gpu_check.sh layer || status=1
  elapsed
fi
if has sanitize; then
  bash tools/gpu_check.sh sanitize || status=1
  elapsed
fi
exit $status
