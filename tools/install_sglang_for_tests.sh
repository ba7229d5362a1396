#!/usr/bin/env bash
# Installs SGLang 0.5.23's Python package into the current interpreter for
# tests/python/test_sglang_dispatcher.py, on a machine without a GPU and
# without replacing its torch.
#
#   bash tools/install_sglang_for_tests.sh
#   MOELINK_PYTHONPATH=build/python python3 -m pytest tests/python/test_sglang_dispatcher.py
#
# SGLang's own requirements pull a CUDA torch and GPU kernel wheels (several
# GiB, over CI's budget), so it goes in with --no-deps, followed by the
# pure-Python modules that importing its dispatcher, plugin and two-batch
# overlap code needs (found by importing them on a CPU machine). torch must
# already be installed; torchvision is taken without dependencies so it
# cannot swap torch for another build.
set -euo pipefail

sglang_version=0.5.23
python3 -c "import torch" 2>/dev/null || {
  echo "install_sglang_for_tests: torch is not installed (pip install torch first)" >&2
  exit 1
}
pip_install() { python3 -m pip install --disable-pip-version-check -q "$@"; }
pip_install --no-deps "sglang==$sglang_version" torchvision
pip_install psutil pybase64 pillow starlette msgspec pyzmq aiohttp dill apache-tvm-ffi \
  sentencepiece einops compressed-tensors gguf partial-json-parser
python3 - <<'EOF'
import sglang.srt.batch_overlap.two_batch_overlap  # noqa: F401  (the deepest import the tests make)
import sglang.srt.layers.moe.token_dispatcher.pplx  # noqa: F401
from importlib.metadata import version
print("install_sglang_for_tests: SGLang", version("sglang"), "imports")
EOF
