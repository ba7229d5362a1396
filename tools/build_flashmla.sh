#!/usr/bin/env bash
# Builds FlashMLA (deepseek-ai/FlashMLA at 9241ae3, the decode kernel issue
# 33 measures moelink against) for Hopper into a directory holding its
# `flash_mla` package, for tools/bench/attention_bench.py --flashmla DIR.
#   bash tools/build_flashmla.sh [DIR]          (default /tmp/moelink-flashmla)
# Source: .deps/flashmla-9241ae3.tar.xz, FlashMLA's tree at that commit with
# CUTLASS 147f567's headers (its submodule) in csrc/cutlass
# (tools/prepare_device_deps.sh packs it).
# Only the bf16 dense decode is compiled (sm90a): its scheduler, combine and
# kernel, and a binding file for it alone (FlashMLA's own binds kernels not
# compiled here). PYTHON: the interpreter with torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dst=${1:-/tmp/moelink-flashmla}
py=${PYTHON:-python3}
if compgen -G "$dst/flash_mla/cuda*.so" >/dev/null; then echo "FlashMLA: built in $dst"; exit 0; fi
src=$root/.deps/flashmla-9241ae3.tar.xz
work=$(mktemp -d /tmp/moelink-flashmla-build.XXXXXX)
[[ -f $src ]] || { echo "FlashMLA: $src is missing (tools/prepare_device_deps.sh packs it)" >&2; exit 1; }
tar xJf "$src" -C "$work"
cd "$work/FlashMLA"
# The dense decode's sources only (every other kernel takes minutes to build).
"$py" - <<'PYEOF'
s = open("setup.py").read()
start = s.index("sources=[")
end = s.index("],", start) + 1
keep = ["csrc/api/api.cpp",
        "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
        "csrc/smxx/decode/combine/combine.cu",
        "csrc/sm90/decode/dense/instantiations/bf16.cu"]
s = s[:start] + "sources=" + repr(keep) + s[end:]
s = s.replace('subprocess.run(["git", "submodule", "update", "--init", "csrc/cutlass"])', "")
open("setup.py", "w").write(s)
# The module binds the dense decode alone: its other bindings name kernels
# not compiled here, which the loader must resolve at import (a pointer to a
# function is not bound lazily).
open("csrc/api/api.cpp", "w").write(
    '#include <pybind11/pybind11.h>\n\n#include "dense_decode.h"\n\n'
    '// tools/build_flashmla.sh (moelink): the bf16 dense decode only.\n'
    'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n'
    '  m.def("dense_decode_fwd", &dense_attn_decode_interface);\n}\n')
PYEOF
# CUDA 13 keeps CCCL's headers (cuda/std/...) in include/cccl, which nvcc
# adds by itself and the host compiler of api.cpp does not.
cccl=$(dirname "$(command -v nvcc)")/../include/cccl
[[ -d $cccl ]] && export CPLUS_INCLUDE_PATH="$(realpath "$cccl")${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
echo "FlashMLA: building the sm90 bf16 dense decode (a few minutes) in $work"
FLASH_MLA_DISABLE_SM100=1 FLASH_MLA_DISABLE_FP16=1 MAX_JOBS=$(nproc) NVCC_THREADS=4 \
  "$py" setup.py build_ext --inplace >"$work/build.log" 2>&1 ||
  { grep -E "error|Error" "$work/build.log" | head -30; echo "FlashMLA: build failed ($work/build.log)" >&2; exit 1; }
mkdir -p "$dst" && cp -r flash_mla "$dst/"
echo "FlashMLA: built in $dst"
