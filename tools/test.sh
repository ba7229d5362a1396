#!/usr/bin/env bash
# Builds moelink and runs every test this machine can run:
#  0. what the build and the tests need (tools/deps.sh: installed as root,
#     else the commands to run are printed);
#  1. the full build (CUDA code compiles wherever nvcc exists, the Python
#     module too) and the GoogleTest suites (GPU tests skip, saying so, when
#     there is no GPU);
#  2. the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer;
#  3. pytest on the module of step 1 (and the request scheduler's
#     multi-process tests on its binaries), and `pip install .` of the
#     package (CPU-only, to check the packaging) with an import.
# On the H200 machine, tools/gpu_check.sh runs the GPU suite and the benchmarks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source tools/deps.sh
moelink_deps test
jobs=${MOELINK_JOBS:-$(nproc)}

echo "== build (build/)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOELINK_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build build -j "$jobs"
echo "== tests"
ctest --test-dir build --output-on-failure -j 1

echo "== CPU tests under ASan + UBSan (build-asan/)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMOELINK_WITH_CUDA=OFF \
  -DMOELINK_BUILD_BENCH=OFF -DMOELINK_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  LSAN_OPTIONS=suppressions="$root/tools/lsan_suppressions.txt" \
  ctest --test-dir build-asan --output-on-failure -j 1

echo "== Python tests (the module of build/; the scheduler's with its binaries)"
MOELINK_PYTHONPATH="$root/build/python" MOELINK_BIN_DIR="$root/build/tools/scheduler" \
  python3 -m pytest -q tests/python

echo "== Python package (pip install ., CPU-only build)"
CMAKE_ARGS="-DMOELINK_WITH_CUDA=OFF" python3 -m pip install -q --disable-pip-version-check \
  --no-build-isolation .
(cd /tmp && python3 -c "import moelink, moelink.scheduler; print('moelink', moelink.__version__, 'installed')")
