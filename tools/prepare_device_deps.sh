#!/usr/bin/env bash
# Copies the build dependencies the GPU machine lacks (it has no package
# registry) into .deps/, which the device run carries: GoogleTest sources,
# the header-only CLI11 and nlohmann/json, Debian's libfabric (with the
# libraries it loads) unpacked into .deps/sysroot for the internode backend,
# the nvidia-cutlass wheel (CUTLASS's headers, unpacked there by
# tools/device_env.sh) for the CUDA expert kernels, FlashInfer's headers
# (packed; unpacked there) for the MLA decode kernel, xxHash (the serving
# engine's block hash) into the same sysroot, the `openai` client's wheels
# that the image lacks (moelink-serve's end-to-end tests) with grpcio and
# protobuf (moelink.scheduler) in .deps/pywheels, gRPC's C++ runtime
# packed (moelink-scheduler), and vLLM's Python files with the wheels they
# import in .deps/pywheels-vllm (the vLLM tests). .deps is then over the 64
# MiB a device call carries: carry the parts a call needs (carry:
# [".deps/pywheels", ...]).
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
# vLLM 0.33.0's Python files (*.py, *.json, *.jinja, *.md: its wheel's
# compiled part, 300 MB, is too big to carry and built for torch 2.14), and
# the wheels its fused-MoE modules import beyond the image's packages, for
# tests/python/test_vllm_prepare_finalize.py on the nvlink backend. No
# dist-info: without it vLLM takes its generic platform (with it, its CUDA
# platform imports vllm._C_stable_libtorch, which is not carried). The
# wheels go to .deps/pywheels-vllm (carried by the vllm runs only).
vdl=$(mktemp -d)
python3 -m pip download -q --no-deps --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$vdl" "vllm==0.33.0"
(cd "$vdl" && python3 -m zipfile -e vllm-*.whl whl &&
  find whl/vllm -type f ! \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name '*.md' \) -delete &&
  tar -C whl -cJf "$deps/vllm-0.33.0-py.tar.xz" vllm)
rm -rf "$vdl"
python3 -m pip download -q --no-deps --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$deps/pywheels-vllm" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 \
  cachetools==8.0.3 cbor2==6.3.0 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3 frozenlist==1.8.0 \
  llguidance==1.7.6 msgspec==0.23.0 multidict==7.2.1 oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 \
  pillow==13.0.0 prometheus-client==0.26.0 propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1 \
  pyzmq==27.3.0 starlette==1.10.0 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
# FlashInfer's MLA headers, packed (the wheel is too big to carry).
source "$root/tools/deps.sh"
moelink_flashinfer_headers "$deps/flashinfer-$flashinfer_version-headers.tar.xz"
# moelink-scheduler on the GPU machine (moelink-serve --engines N [--pd]):
# gRPC's C++ runtime from Debian, packed (.deps/grpc-runtime.tar.xz, 20 MB
# unpacked), and the Python side's grpcio and protobuf (the versions of the
# grpcio-tools that tools/build_for_device.sh generates the protocol code
# with) beside the openai client in .deps/pywheels; tools/device_env.sh
# takes both where carried.
debs=$(mktemp -d)
(cd "$debs" && apt-get download -q libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 \
  libc-ares2 >/dev/null 2>&1 && mkdir root && for f in *.deb; do dpkg -x "$f" root; done &&
  tar -C root -cJf "$deps/grpc-runtime.tar.xz" usr/lib)
rm -rf "$debs"
python3 -m pip download -q --no-deps --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$deps/pywheels" "grpcio==$grpcio_version" "protobuf==$protobuf_version"
# FlashMLA's source at the commit issue 33 measures (with its CUTLASS
# submodule), packed: tools/build_flashmla.sh builds it on the device. Last,
# so that a machine without GitHub still gets everything else; there, pack
# FlashMLA 9241ae3 with CUTLASS 147f567's include/ and tools/util/include
# in FlashMLA/csrc/cutlass (e.g. `git archive` of mirrors) into that file.
fm=$(mktemp -d)
if git clone -q https://github.com/deepseek-ai/FlashMLA "$fm/FlashMLA" &&
   git -C "$fm/FlashMLA" checkout -q 9241ae3ef9bac614dd25e45e507e089f888280e0 &&
   git -C "$fm/FlashMLA" submodule update --init -q csrc/cutlass; then
  rm -rf "$fm/FlashMLA/.git" "$fm/FlashMLA/csrc/cutlass/.git"
  tar -C "$fm" -cJf "$deps/flashmla-9241ae3.tar.xz" FlashMLA
  rm -rf "$fm"
else
  rm -rf "$fm"
  echo "prepare_device_deps: FlashMLA could not be cloned: no .deps/flashmla-9241ae3.tar.xz" \
       "(gpu_check.sh attention then runs without FlashMLA)" >&2
  du -sh "$deps"
  exit 1
fi
# libfabric with CUDA memory (the P/D hand-off of GPU caches): tools/build_libfabric_cuda.sh.
du -sh "$deps"
