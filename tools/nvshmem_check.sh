#!/usr/bin/env bash
# Runs on the H200 machine (the device tool): builds moelink with the NVSHMEM
# backend, runs its GPU tests, then moelink-bench with nvshmem beside nvlink,
# NCCL and NVSHMEM's dense all-to-all. Results and logs go to $OUT (default
# ./gpu-out).
#   bash tools/nvshmem_check.sh [steps...]   steps: build test bench (default: all)
# Environment:
#   MOELINK_GTEST_FILTER    tests to run (default: every NVSHMEM test)
#   MOELINK_TEST_NVSHMEM_MPG=0  skip the cases that need several ranks on one GPU
#   MOELINK_BENCH_NPROC     ranks of the benchmark (default: the GPU count, at least 2)
#   MOELINK_BENCH_ARGS      extra moelink-bench arguments
# NVSHMEM comes from the nvidia-nvshmem-cu13 wheel of the python3 on PATH
# (site-packages/nvidia/nvshmem), or NVSHMEM_HOME. Needs .deps/ from
# tools/prepare_device_deps.sh, carried with the call.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
steps=${*:-build test bench}
source "$root/tools/device_env.sh"
echo "NVSHMEM from $nvshmem_home; $ngpu GPU(s)"

if has build; then
  nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -8
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMOELINK_GTEST_SOURCE_DIR="$root/.deps/googletest" \
    -DMOELINK_EXTRA_INCLUDE_DIR="$root/.deps/include" \
    -DNCCL_ROOT="$nccl_home" -DNVSHMEM_HOME="$nvshmem_home" "${fabric_args[@]}" \
    -DPython_EXECUTABLE="$py" >"$OUT/nvshmem-configure.log" 2>&1 ||
    { tail -30 "$OUT/nvshmem-configure.log"; exit 1; }
  grep "NVSHMEM" "$OUT/nvshmem-configure.log"
  grep -q 'backend "nvshmem" built' "$OUT/nvshmem-configure.log" ||
    { echo "NVSHMEM was not found: see $OUT/nvshmem-configure.log"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" --target moelink_tests moelink-bench \
    >"$OUT/nvshmem-build.log" 2>&1 || { grep -B2 -A10 error "$OUT/nvshmem-build.log" | head -60; exit 1; }
  echo "build ok"
fi

if has test; then
  tests=build-gpu/tests/moelink_tests
  echo "== NVSHMEM smoke (one rank, then two)"
  # NVSHMEM_DEBUG=WARN: if NVSHMEM cannot start, its reason lands in the log.
  NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-WARN} timeout 300 $tests \
    --gtest_filter='NvshmemAllToAll.SmallW1Bf16:NvshmemAllToAll.SmallW2Bf16' \
    >"$OUT/nvshmem-smoke.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|FAILED  \]|NVSHMEM (WARN|ERROR)" "$OUT/nvshmem-smoke.log" | head -20
  echo "== NVSHMEM GPU tests"
  timeout 3000 $tests --gtest_filter="${MOELINK_GTEST_FILTER:-*Nvshmem*:NVSHMEM/*}" \
    --gtest_output="json:$OUT/nvshmem-tests.json" >"$OUT/nvshmem-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED" "$OUT/nvshmem-tests.log" | tail -40
fi

if has bench; then
  np=${MOELINK_BENCH_NPROC:-$(( ngpu > 2 ? ngpu : 2 ))}
  bench=build-gpu/tools/bench/moelink-bench
  if (( np > ngpu )); then
    # Several PEs per GPU: NVSHMEM's limited multi-process-per-GPU mode,
    # kernels of different processes time-sliced. Checks correctness and
    # that the runs finish; the times say nothing about the transport, and
    # NCCL and the dense baseline are skipped (they need one GPU per rank).
    echo "== moelink-bench: $np ranks on $ngpu GPU(s) (shared GPUs: times are not meaningful)"
    shape="--tokens 1,128 --iters 50 --warmup 5"
  else
    echo "== moelink-bench: $np ranks, one GPU each"
    shape="--tokens 1,128,4096 --iters 1000 --warmup 50 --split --graph"
  fi
  cmd=($bench --nproc "$np" --backend nvshmem --compare nvlink $shape
       --machine "nvidia-h200-x$ngpu" --json "$OUT/bench-nvshmem-np$np.json" ${MOELINK_BENCH_ARGS:-})
  echo "${cmd[*]}"
  "${cmd[@]}" >"$OUT/bench-nvshmem-np$np.log" 2>&1 || status=1
  tail -30 "$OUT/bench-nvshmem-np$np.log"
  if (( ngpu == 1 )); then
    # One rank on the one GPU: NCCL and NVSHMEM's dense all-to-all run too
    # (self copies only), which checks that the baselines work end to end.
    echo "== moelink-bench: 1 rank (baselines end to end)"
    cmd=($bench --nproc 1 --backend nvshmem --compare nvlink --tokens 1,128 --iters 200 --warmup 20
         --machine "nvidia-h200-x1" --json "$OUT/bench-nvshmem-np1.json" ${MOELINK_BENCH_ARGS:-})
    echo "${cmd[*]}"
    "${cmd[@]}" >"$OUT/bench-nvshmem-np1.log" 2>&1 || status=1
    tail -14 "$OUT/bench-nvshmem-np1.log"
  fi
fi
exit $status
