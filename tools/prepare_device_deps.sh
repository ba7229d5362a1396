#!/usr/bin/env bash
# Copies the build dependencies the GPU machine lacks (it has no package
# registry) into .deps/, which the device run carries: GoogleTest sources,
# the header-only CLI11 and nlohmann/json, Debian's libfabric (with the
# libraries it loads) unpacked into .deps/sysroot for the internode backend,
# the nvidia-cutlass wheel (CUTLASS's headers, unpacked there by
# tools/device_env.sh) for the CUDA expert kernels, and FlashInfer's headers
# (packed; unpacked there) for the MLA decode kernel.
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
  >/dev/null 2>&1)
for f in "$debs"/*.deb; do dpkg -x "$f" "$deps/sysroot"; done
rm -rf "$debs" "$deps/sysroot/usr/share"
# CUTLASS, the version .ci/run pins, as its wheel (7 MB; 27 MB unpacked).
python3 -m pip download -q --no-deps --disable-pip-version-check -d "$deps/wheels" \
  "nvidia-cutlass==$(sed -n 's/^cutlass_version=\([^ ]*\).*/\1/p' "$root/tools/deps.sh")"
# FlashInfer's MLA headers, packed (the wheel is too big to carry).
source "$root/tools/deps.sh"
moelink_flashinfer_headers "$deps/flashinfer-$flashinfer_version-headers.tar.xz"
du -sh "$deps"
