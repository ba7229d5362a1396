#!/usr/bin/env bash
# Builds moelink and runs every test this machine can run:
#  1. the full build (CUDA code compiles wherever nvcc exists) and the
#     GoogleTest suite (GPU tests skip, saying so, when there is no GPU);
#  2. the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer;
#  3. the Python package (pip install .) and its pytest suite.
# On the H200 machine, tools/gpu_check.sh runs the GPU suite and the benchmark.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=${MOELINK_JOBS:-$(nproc)}

echo "== build (build/)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
echo "== tests"
ctest --test-dir build --output-on-failure -j 1

echo "== CPU tests under ASan + UBSan (build-asan/)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMOELINK_WITH_CUDA=OFF \
  -DMOELINK_BUILD_BENCH=OFF -DMOELINK_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j 1

echo "== Python package and binding tests"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation . 
python3 -m pytest -q tests/python
