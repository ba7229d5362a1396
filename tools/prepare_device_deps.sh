#!/usr/bin/env bash
# Copies the build dependencies the GPU machine lacks (it has no package
# registry) into .deps/, which the device run carries: GoogleTest sources,
# the header-only CLI11 and nlohmann/json, Debian's libfabric (with the
# libraries it loads) unpacked into .deps/sysroot for the internode backend,
# the nvidia-cutlass wheel (CUTLASS's headers, unpacked there by
# tools/device_env.sh) for the CUDA expert kernels, FlashInfer's headers
# (packed; unpacked there) for the MLA decode kernel, xxHash (the serving
# engine's block hash) into the same sysroot, and the `openai` client's
# wheels that the image lacks (moelink-serve's end-to-end tests).
# Run here, on a Debian machine with googletest, libcli11-dev and
# nlohmann-json3-dev installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.deps"
rm -rf "$deps"
mkdir -p "$deps/include"
cp -r /usr/src/googletest "$deps/googletest"
cp -r /usr/include/CLI "$deps/include/CLI"
cp -r /usr/include/nlohmann "$deps/include/nlohmann"
# libfabric 1.17 and what it links, unpacked (not installed): the GPU
# machine builds against it through PKG_CONFIG_SYSROOT_DIR and runs with
# LD_LIBRARY_PATH (tools/gpu_check.sh).
debs=$(mktemp -d)
(cd "$debs" && apt-get download -q libfabric1 libfabric-dev libibverbs1 librdmacm1 \
  ibverbs-providers libpsm-infinipath1 libpsm2-2 libnl-3-200 libnl-route-3-200 libnuma1 \
  libxxhash0 libxxhash-dev >/dev/null 2>&1)
for f in "$debs"/*.deb; do dpkg -x "$f" "$deps/sysroot"; done
rm -rf "$debs" "$deps/sysroot/usr/share"
# pkg-config finds xxHash there (PKG_CONFIG_PATH, tools/device_env.sh) once
# its .pc names the sysroot relative to itself instead of /usr.
sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../../..|' \
  "$deps/sysroot/usr/lib/x86_64-linux-gnu/pkgconfig/libxxhash.pc"
# CUTLASS, the version .ci/run pins, as its wheel (7 MB; 27 MB unpacked).
python3 -m pip download -q --no-deps --disable-pip-version-check -d "$deps/wheels" \
  "nvidia-cutlass==$(sed -n 's/^cutlass_version=\([^ ]*\).*/\1/p' "$root/tools/deps.sh")"
# The openai client (and what it needs beyond the image's packages), for
# tests/python/test_serve.py; tools/device_env.sh installs them there.
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$deps/pywheels" "openai==3.63.0"
# FlashInfer's MLA headers, packed (the wheel is too big to carry).
source "$root/tools/deps.sh"
moelink_flashinfer_headers "$deps/flashinfer-$flashinfer_version-headers.tar.xz"
# FlashMLA's source at the commit issue 33 measures (with its CUTLASS
# submodule), packed: tools/build_flashmla.sh builds it on the device.
if [[ ! -f $deps/flashmla-9241ae3.tar.xz ]]; then
  fm=$(mktemp -d)
  git clone -q https://github.com/deepseek-ai/FlashMLA "$fm/FlashMLA"
  git -C "$fm/FlashMLA" checkout -q 9241ae3ef9bac614dd25e45e507e089f888280e0
  git -C "$fm/FlashMLA" submodule update --init -q csrc/cutlass
  rm -rf "$fm/FlashMLA/.git" "$fm/FlashMLA/csrc/cutlass/.git"
  tar -C "$fm" -cJf "$deps/flashmla-9241ae3.tar.xz" FlashMLA
  rm -rf "$fm"
fi
# libfabric with CUDA memory (the P/D hand-off of GPU caches): tools/build_libfabric_cuda.sh.
du -sh "$deps"
