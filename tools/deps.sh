# The one list of what moelink's build and tests need from Debian and PyPI,
# and the code that makes sure it is there. Sourced by tools/demo.sh,
# tools/test.sh and .ci/run; tools/prepare_device_deps.sh reads the pins.
#
#   source tools/deps.sh && moelink_deps build   # to build
#   source tools/deps.sh && moelink_deps test    # to build and run the tests
#   bash tools/deps.sh [build|test]              # the same, standalone
#
# What is present is left alone. What is missing is installed when running as
# root (apt-get, pip); otherwise the exact commands are printed and it fails.
# The CUDA toolkit (nvcc) is not installed here: without it moelink builds
# its CPU parts only.

cutlass_version=4.2.0.0  # CUTLASS's C++ headers (nvidia-cutlass wheel) for the expert kernels
flashinfer_version=0.7.4  # FlashInfer's C++ headers (flashinfer-python wheel) for the MLA decode and prefill kernels
# The GPU machine's moelink.scheduler (tools/prepare_device_deps.sh carries
# grpcio and protobuf there; tools/build_for_device.sh generates the
# protocol code with this grpcio-tools, which needs that protobuf or newer).
grpcio_tools_version=1.85.1 grpcio_version=1.85.4 protobuf_version=7.36.2

# FlashMLA (deepseek-ai/FlashMLA) for its sm90 dense MLA decode, compiled
# from its source against the CUTLASS above (MOELINK_FLASHMLA_DIR); issue
# 33's benchmark measures the same commit.
flashmla_commit=9241ae3ef9bac614dd25e45e507e089f888280e0

# FlashMLA's source tree at $flashmla_commit (without its CUTLASS submodule:
# moelink's CUTLASS builds the decode), unpacked into $1, from GitHub.
moelink_flashmla_source() {
  local out=$1
  mkdir -p "$out" && curl -fsSL "https://codeload.github.com/deepseek-ai/FlashMLA/tar.gz/$flashmla_commit" |
    tar xz -C "$out" --strip-components=1
}

# FlashInfer's MLA headers with the CUTLASS and CCCL they are written
# against, from the flashinfer-python wheel (100 MB), packed into $1
# (tar.xz, 3.5 MB): what -DMOELINK_FLASHINFER_DIR needs, unpacked.
moelink_flashinfer_headers() {
  local out=$1 tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" \
    "flashinfer-python==$flashinfer_version" || { rm -rf "$tmp"; return 1; }
  python3 -m zipfile -e "$tmp"/flashinfer_python-*.whl "$tmp/w" || { rm -rf "$tmp"; return 1; }
  tar cJf "$out" -C "$tmp/w/flashinfer/data" include cutlass/include cutlass/tools/util/include \
    cccl/libcudacxx/include cccl/cub/cub cccl/thrust/thrust
  rm -rf "$tmp"
}

moelink_apt_build=(cmake ninja-build g++ pkg-config googletest libgtest-dev libcli11-dev
                   nlohmann-json3-dev libfabric-dev libibverbs-dev
                   libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc libcpp-httplib-dev
                   libxxhash-dev)
moelink_pip_build=("nanobind>=2.0" "scikit-build-core>=0.10" "nvidia-cutlass==$cutlass_version"
                   "grpcio-tools>=1.60")
moelink_pip_test=("numpy>=1.21" "pytest>=7" "ml-dtypes>=0.2" "grpcio>=1.60" "xxhash>=3.0"
                  "tokenizers>=0.15" "jinja2>=3.0" "openai>=1.0")

# Prints the requirements (pip form) that python3 lacks or has at another version.
_moelink_missing_pip() {
  python3 - "$@" <<'EOF'
import re, sys
try:
    from importlib.metadata import version, PackageNotFoundError
except ImportError:  # Python < 3.8
    sys.exit("python3 is older than 3.8")
def parts(v):
    return [int(p) if p.isdigit() else 0 for p in re.findall(r"\d+|[a-z]+", v.lower())][:4]
for req in sys.argv[1:]:
    name, op, want = re.match(r"([A-Za-z0-9_.-]+)(>=|==)?(.*)", req).groups()
    try:
        have = version(name)
    except PackageNotFoundError:
        print(req)
        continue
    if op == "==" and parts(have) != parts(want):
        print(req)
    elif op == ">=" and parts(have) < parts(want):
        print(req)
EOF
}

_moelink_missing_apt() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

# moelink_deps build|test: installs (as root) or names what is missing.
moelink_deps() {
  local what=${1:-build}
  local pip_reqs=("${moelink_pip_build[@]}")
  [[ $what == test ]] && pip_reqs+=("${moelink_pip_test[@]}")
  if ! command -v python3 >/dev/null; then
    echo "moelink: python3 is missing (apt-get install python3 python3-pip)" >&2
    return 1
  fi
  local apt_missing=() pip_missing=()
  if command -v dpkg-query >/dev/null; then
    mapfile -t apt_missing < <(_moelink_missing_apt "${moelink_apt_build[@]}")
  fi
  mapfile -t pip_missing < <(_moelink_missing_pip "${pip_reqs[@]}")
  if [[ ${#apt_missing[@]} -eq 0 && ${#pip_missing[@]} -eq 0 ]]; then
    return 0
  fi
  local apt_cmd="apt-get update && apt-get install -y --no-install-recommends ${apt_missing[*]}"
  local pip_cmd
  pip_cmd=$(printf 'python3 -m pip install'; printf " '%s'" "${pip_missing[@]}")
  if [[ $(id -u) -ne 0 ]]; then
    echo "moelink: missing what the $what needs; as root, run:" >&2
    [[ ${#apt_missing[@]} -gt 0 ]] && echo "  $apt_cmd" >&2
    [[ ${#pip_missing[@]} -gt 0 ]] && echo "  $pip_cmd" >&2
    echo "(or run this script as root and it installs them)" >&2
    return 1
  fi
  if [[ ${#apt_missing[@]} -gt 0 ]]; then
    echo "moelink: installing ${apt_missing[*]} (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null ||
      { echo "moelink: apt-get install failed: $apt_cmd" >&2; return 1; }
  fi
  if [[ ${#pip_missing[@]} -gt 0 ]]; then
    echo "moelink: installing ${pip_missing[*]} (pip)" >&2
    python3 -m pip install -q --disable-pip-version-check "${pip_missing[@]}" ||
      { echo "moelink: pip install failed: $pip_cmd" >&2; return 1; }
  fi
}

# Standalone: bash tools/deps.sh [build|test]
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -euo pipefail
  moelink_deps "${1:-build}"
fi
