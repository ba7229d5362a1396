# Sourced by the H200 machine's scripts (gpu_check.sh, nvshmem_check.sh), after
# they set `root` (the checkout) and `steps`: the environment of every device
# run. Defines OUT, py, site, nccl_home, nvshmem_home, fabric_args, cutlass_args,
# flashinfer_args, ngpu, machine, MOELINK_GIT_COMMIT, status and has().
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off: it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
py=$(command -v python3)
site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nccl_home="$site/nvidia/nccl"
# NVSHMEM (the nvshmem backend) from the nvidia-nvshmem-cu13 wheel or
# NVSHMEM_HOME: binaries carry an RPATH to its lib/; exported too for anything
# started without it (and NVSHMEM's own plugins sit beside it).
nvshmem_home=${NVSHMEM_HOME:-$site/nvidia/nvshmem}
export LD_LIBRARY_PATH="$nvshmem_home/lib:$nccl_home/lib:${LD_LIBRARY_PATH:-}"
# cuBLAS for binaries built on the CPU machine (tools/build_for_device.sh),
# whose run path names that machine's CUDA directory.
[[ -d /usr/local/cuda/lib64 ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"
# libfabric (the internode backends) from Debian's packages, unpacked into
# .deps/sysroot by tools/prepare_device_deps.sh: that machine has none.
fabric_args=()
if [[ -d "$root/.deps/sysroot/usr/include/rdma" ]]; then
  sysroot="$root/.deps/sysroot"
  export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu:$sysroot/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
  fabric_args=(-DMOELINK_LIBFABRIC_ROOT="$sysroot/usr")
  # xxHash, for the serving engine (its .pc is relative to the sysroot).
  export PKG_CONFIG_PATH="$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
fi
# gRPC's C++ runtime for moelink-scheduler, where a run carries it
# (.deps/grpc-runtime.tar.xz, tools/prepare_device_deps.sh), unpacked once.
if [[ -f "$root/.deps/grpc-runtime.tar.xz" ]]; then
  grpc_dir=/tmp/moelink-grpc-runtime
  [[ -d $grpc_dir/usr/lib ]] || { mkdir -p $grpc_dir && tar xJf "$root/.deps/grpc-runtime.tar.xz" -C $grpc_dir; }
  export LD_LIBRARY_PATH="$grpc_dir/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
fi
# Python packages the image lacks (.deps/pywheels: the openai client,
# grpcio and protobuf for moelink.scheduler; .deps/pywheels-vllm: what
# vLLM's Python files import), installed outside the checkout once per
# machine and set of wheels.
pywheels=$(ls "$root"/.deps/pywheels/*.whl "$root"/.deps/pywheels-vllm/*.whl 2>/dev/null || true)
if [[ -n $pywheels ]]; then
  pysite=/tmp/moelink-pysite
  wheels=$(for w in $pywheels; do basename "$w"; done)
  [[ -f $pysite/.wheels && $(cat $pysite/.wheels) == "$wheels" ]] ||
    { $py -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --no-cache-dir --target "$pysite" $pywheels && echo "$wheels" >$pysite/.wheels; }
  export PYTHONPATH="$pysite${PYTHONPATH:+:$PYTHONPATH}"
fi
# vLLM's Python files (tools/prepare_device_deps.sh packs them from its
# wheel, whose compiled part is too large to carry), for the vLLM tests.
vllm_pack=$(ls "$root"/.deps/vllm-*-py.tar.xz 2>/dev/null | head -1)
if [[ -n $vllm_pack ]]; then
  vllm_src=/tmp/moelink-vllm
  [[ -f $vllm_src/vllm/__init__.py ]] || { mkdir -p $vllm_src && tar xJf "$vllm_pack" -C $vllm_src; }
fi
# CUTLASS (the CUDA expert kernels) from the wheel tools/prepare_device_deps.sh
# put in .deps/wheels, unpacked outside the checkout.
cutlass_args=()
cutlass_wheel=$(ls "$root"/.deps/wheels/nvidia_cutlass-*.whl 2>/dev/null | head -1)
if [[ -n $cutlass_wheel ]]; then
  cutlass_dir=/tmp/moelink-cutlass
  [[ -f $cutlass_dir/cutlass_library/source/include/cutlass/cutlass.h ]] ||
    $py -m zipfile -e "$cutlass_wheel" "$cutlass_dir"
  cutlass_args=(-DMOELINK_CUTLASS_DIR="$cutlass_dir/cutlass_library/source")
fi
# FlashInfer's MLA headers, packed by tools/prepare_device_deps.sh.
flashinfer_args=()
flashinfer_pack=$(ls "$root"/.deps/flashinfer-*-headers.tar.xz 2>/dev/null | head -1)
if [[ -n $flashinfer_pack ]]; then
  flashinfer_dir=/tmp/moelink-flashinfer
  [[ -f $flashinfer_dir/cutlass/tools/util/include/cutlass/util/command_line.h ]] ||
    { mkdir -p "$flashinfer_dir" && tar xJf "$flashinfer_pack" -C "$flashinfer_dir"; }
  flashinfer_args=(-DMOELINK_FLASHINFER_DIR="$flashinfer_dir")
fi
ngpu=$(nvidia-smi -L | wc -l)
# The machine as the benchmarks' JSON names it: nvidia-h200-x1, nvidia-h100-x1, ...
# (the device tool lends H100s for H200s when those do not come).
gpu_kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | head -1 | tr 'A-Z' 'a-z')
machine="nvidia-${gpu_kind:-gpu}-x$ngpu"
# The device copy's .git may be older than its tree: a commit passed in wins.
export MOELINK_GIT_COMMIT=${MOELINK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
