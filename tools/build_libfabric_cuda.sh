#!/usr/bin/env bash
# Builds libfabric with CUDA memory support (FI_HMEM CUDA, the CUDA
# libraries loaded at run time) into .deps/libfabric-cuda.tar.xz, for the
# device machine: Debian's libfabric 1.17 (tools/prepare_device_deps.sh's
# sysroot) takes no GPU memory (tcp: no FI_HMEM; shm: fi_mr_regattr
# ENOSYS), so the P/D hand-off of a GPU model's KV cache preloads this one
# there (tools/gpu_check.sh pd-gpu).
#   bash tools/build_libfabric_cuda.sh [libfabric source tree]
# Without a source tree: clones ofiwg/libfabric at $LIBFABRIC_TAG (v1.22.0).
# Needs autoconf, automake, libtool, make, CUDA's headers (/usr/local/cuda)
# and pip (NVML's headers come from the nvidia-nvml-dev wheel).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tag=${LIBFABRIC_TAG:-v1.22.0}
work=$(mktemp -d /tmp/moelink-libfabric.XXXXXX)
src=${1:-}
if [[ -z $src ]]; then
  git clone -q --depth 1 -b "$tag" https://github.com/ofiwg/libfabric "$work/src"
  src=$work/src
fi
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/whl" nvidia-nvml-dev==13.0.87
python3 -m zipfile -e "$work"/whl/nvidia_nvml_dev-*.whl "$work/nvml"
nvml_include=$(dirname "$(find "$work/nvml" -name nvml.h | head -1)")
# libfabric 1.22 dlopens "libcuda.so" and "libcudart.so" only; drivers and
# runtimes often ship the versioned names alone.
sed -i 's|dlopen("libcuda.so", RTLD_NOW);|dlopen("libcuda.so.1", RTLD_NOW);\n\tif (!cuda_attr.driver_handle)\n\t\tcuda_attr.driver_handle = dlopen("libcuda.so", RTLD_NOW);|' \
  "$src/src/hmem_cuda.c"
sed -i 's|cuda_attr.runtime_handle = dlopen("libcudart.so", RTLD_NOW);|cuda_attr.runtime_handle = dlopen("libcudart.so", RTLD_NOW);\n\tif (!cuda_attr.runtime_handle)\n\t\tcuda_attr.runtime_handle = dlopen("libcudart.so.13", RTLD_NOW);|' \
  "$src/src/hmem_cuda.c"
cd "$src"
[[ -x configure ]] || ./autogen.sh >"$work/autogen.log" 2>&1
./configure CPPFLAGS="-I$nvml_include" --prefix="$work/install" --with-cuda=/usr/local/cuda --enable-cuda-dlopen \
  --enable-shm=yes --enable-tcp=yes --enable-rxm=yes --enable-sockets=no --enable-udp=yes --enable-verbs=no \
  --enable-efa=no --enable-psm2=no --enable-psm3=no --enable-opx=no --enable-usnic=no --enable-mrail=no \
  --enable-hook_debug=no --enable-perf=no --disable-static >"$work/configure.log" 2>&1
grep -q "define HAVE_CUDA 1" config.h || { echo "libfabric: configure found no CUDA" >&2; exit 1; }
make -j"$(nproc)" >"$work/make.log" 2>&1
make install >"$work/install.log" 2>&1
mkdir -p "$root/.deps"
tar -C "$work/install" -cJf "$root/.deps/libfabric-cuda.tar.xz" lib/libfabric.so lib/libfabric.so.1 \
  $(cd "$work/install" && ls lib/libfabric.so.1.*) bin/fi_info
echo "libfabric $tag with CUDA: $root/.deps/libfabric-cuda.tar.xz"
