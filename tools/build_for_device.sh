#!/usr/bin/env bash
# Builds, on this (CPU) machine, the test binaries and the Python module the
# H200 machine runs, so a device call carries them instead of spending its
# minutes on the build:
#   bash tools/build_for_device.sh [targets...]
#   (default: _C moelink_attention_tests moelink_model_tests moelink-plan;
#   moelink-scheduler adds the scheduler, carried with
#   .deps/grpc-runtime.tar.xz and .deps/pywheels (grpcio), for
#   `gpu_check.sh pd-gpu`'s moelink-serve --pd)
# Then, on the device (paths relative to the checkout; the build tree is
# build-device):
#   run(carry=[build-device/tests/..., build-device/python, .deps/sysroot],
#       command="MOELINK_BUILD_DIR=build-device bash tools/gpu_check.sh test model ...")
# The tree matches the device: sm_90a, Release, the Python module for
# python3.12 (PYTHON, default the pyenv 3.12 here; it needs nanobind:
# `$PYTHON -m pip install nanobind`), CUTLASS (MOELINK_CUTLASS_DIR, default
# the nvidia-cutlass wheel's source dir) and FlashInfer's headers
# (MOELINK_FLASHINFER_DIR, default /tmp/fi: `source tools/deps.sh;
# moelink_flashinfer_headers x.tar.xz` and unpack) and FlashMLA's source
# (MOELINK_FLASHMLA_DIR, default /tmp/flashmla: `moelink_flashmla_source
# /tmp/flashmla`, or `git archive $flashmla_commit` of a mirror). The binaries link
# libfabric, rdma-core and xxHash from this machine's Debian: carry
# .deps/sysroot (tools/prepare_device_deps.sh), which device_env.sh puts on
# LD_LIBRARY_PATH; the CUDA runtime is linked statically and cuBLAS comes
# from the device's CUDA 13. Prints what to carry and its size (64 MiB a
# call at most).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3.12}
cutlass=${MOELINK_CUTLASS_DIR:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))' 2>/dev/null || true)}
flashinfer=${MOELINK_FLASHINFER_DIR:-/tmp/fi}
flashmla=${MOELINK_FLASHMLA_DIR:-/tmp/flashmla}
targets=${*:-_C moelink_attention_tests moelink_model_tests moelink-plan}
[[ -x $py ]] || { echo "build_for_device: no Python at $py (set PYTHON to a python3.12)" >&2; exit 1; }
$py -m nanobind --cmake_dir >/dev/null 2>&1 || { echo "build_for_device: $py has no nanobind ($py -m pip install nanobind)" >&2; exit 1; }
# moelink.scheduler's protocol code is generated with grpcio-tools (the
# version whose grpcio and protobuf tools/prepare_device_deps.sh carries).
source tools/deps.sh
$py -c 'import grpc_tools.protoc' 2>/dev/null ||
  echo "build_for_device: $py has no grpcio-tools: no moelink.scheduler protocol code" \
       "($py -m pip install grpcio-tools==$grpcio_tools_version)" >&2
[[ -f $flashinfer/include/flashinfer/attention/mla_hopper.cuh ]] ||
  echo "build_for_device: no FlashInfer headers in $flashinfer: the build runs moelink's kernels only" >&2
[[ -f $flashmla/csrc/sm90/decode/dense/splitkv_mla.cuh ]] ||
  echo "build_for_device: no FlashMLA source in $flashmla: the decode runs without FlashMLA's kernel" >&2
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DMOELINK_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" \
  ${cutlass:+-DMOELINK_CUTLASS_DIR="$cutlass"} -DMOELINK_FLASHINFER_DIR="$flashinfer" \
  -DMOELINK_FLASHMLA_DIR="$flashmla" >/dev/null
cmake --build build-device --target $targets
carry=()
for t in $targets; do
  case $t in
    _C) carry+=(build-device/python) ;;
    moelink-plan) carry+=(build-device/tools/plan/moelink-plan) ;;
    moelink-scheduler) carry+=(build-device/tools/scheduler/moelink-scheduler .deps/grpc-runtime.tar.xz .deps/pywheels) ;;
    *) [[ -f build-device/tests/$t ]] && carry+=(build-device/tests/$t) ;;
  esac
done
echo "carry: ${carry[*]} .deps/sysroot"
du -shc "${carry[@]}" .deps/sysroot | tail -1
