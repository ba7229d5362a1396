#!/usr/bin/env bash
# Runs on the H200 machine (the device tool): builds everything, runs the GPU
# test suite, the binding tests with torch, the compute-sanitizer pass and the
# benchmark, in one call. Results and logs go to $OUT (default ./gpu-out).
#   bash tools/gpu_check.sh [steps...]
#   steps: build test python sanitize bench internode experts (default: all)
#   experts: tools/bench/experts_bench.py, the expert kernels beside
#   torch._scaled_grouped_mm, the copy bandwidth and the dense fp8 peak
#   (MOELINK_EXPERTS_BENCH_ARGS adds arguments).
#   layer (not in the default): tools/bench/layer_bench.py, the MoE layer
#   stage by stage (MOELINK_LAYER_BENCH_ARGS adds arguments), then one EP8
#   rank's stand-in (--experts 32, mode none: layer-ep8-rank.json), then
#   the attention step (attention_bench.py --step-kernels, 128 heads, kv
#   5000, batch 1 to 128, q_len 1 and 2: attention-steps.json).
#   model (not in the default): tools/bench/model_bench.py, the full-width
#   model's decode step beside moelink-plan's prediction on this GPU's
#   profile, calibrated by the layer step's files where that ran first
#   (MOELINK_MODEL_BENCH_ARGS adds arguments).
#   model-sanitize (not in the default): compute-sanitizer memcheck over a
#   short model_bench.py run (the ep8 model of one layer, every batch, q_len
#   1 then 2, graphed steps replayed after other buckets' steps: where the
#   stale-buffer illegal addresses showed; MOELINK_MODEL_SANITIZE_ARGS
#   replaces the arguments).
#   serve (not in the default): tools/bench/serve_bench.py, moelink-serve on
#   a full-width EP8-shaped model (3 dense + 2 MoE layers of 32 experts)
#   under load (MOELINK_SERVE_BENCH_ARGS replaces the default 64 requests a
#   cell at concurrency 1, 16 and 64, 64 output tokens; the model step's
#   model.json, when there, gives the bare step beside it).
#   serve-rate (not in the default): the same server under Poisson
#   arrivals (issue 35's request rates): 2, 8 and 32 requests/s, at most
#   64 in flight, 64 requests of 64 tokens a cell, both traces, cache on
#   (serve-rate.json).
#   pd-gpu (not in the default): the P/D hand-off tests on the nvlink
#   backend (KV caches in GPU memory) with .deps/libfabric-cuda.tar.xz's
#   libfabric (FI_HMEM CUDA) preloaded; where moelink-scheduler is built,
#   moelink-serve --engines 2 --pd on the GPU too (test_serve_pd.py).
#   attention (not in the default): tools/bench/attention_bench.py, MLA
#   decode on moelink's kernel, FlashInfer's and FlashMLA's (built first by
#   tools/build_flashmla.sh from .deps/flashmla-9241ae3.tar.xz, about 2
#   minutes), the merged qkv_a_proj against its two GEMMs apart and the
#   W_UK / W_UV batched GEMMs against torch.bmm
#   (MOELINK_ATTENTION_BENCH_ARGS adds arguments).
#   seesaw (not in the default): moelink's out-of-step decode kernel
#   everywhere it applies (MOELINK_MLA_DECODE_SEESAW=1; by default it runs
#   from 32 decode rows): the decode tests under it, each named
#   as it runs (seesaw-tests.log; 300 s at most: a kernel that hangs on a
#   transaction barrier fails here, not the call), then attention_bench.py
#   at 128 heads, batch 1 / 32 / 128, kv 5000, seesaw off and on, two
#   interleaved rounds (decode-seesaw{0,1}-r{1,2}.json).
#   seesaw-trace (not in the default): the seesaw kernel's phases at 128
#   requests of 128 heads, kv 5000 (MOELINK_MLA_DECODE_SEESAW_TRACE, then
#   tools/bench/seesaw_trace_report.py; seesaw-trace.txt).
#   head-gemm (not in the default): MLAOptions.head_gemm bf16 (cuBLAS)
#   against fp8 (the grouped GEMM): the attention tests *HeadGemm* (both
#   against the reference on the CUDA and CPU paths, a bad value refused,
#   fp8 in a decode graph), then attention_bench.py (128 and 16
#   heads, batch 1 / 32 / 128, q_len 1 and 2, kv 5000, --step-kernels) and
#   model_bench.py (ep8, batch 1 / 32 / 128, q_len 1 and 2), bf16 and fp8
#   interleaved, two rounds (head-gemm-*.json).
#   split-k (not in the default): the split over K of the dense GEMMs
#   (issue 33's qkv_a): the expert tests *SplitK*:*Dense* (every forced
#   slice count against the reference, row tiles included), then
#   attention_bench.py --qkv-a (1 to 256 tokens) and model_bench.py (ep8,
#   batch 1 / 32 / 128, q_len 1) under each MOELINK_EXPERTS_SPLIT_K value
#   of MOELINK_SPLIT_K_SETTINGS (default "1 auto": no split against the
#   library's choice), interleaved, two rounds (split-k-*.json).
#   stream-k (not in the default): the dense GEMM split over K in one
#   kernel (MOELINK_EXPERTS_STREAM_K; issue 33's qkv_a): the expert tests
#   *DenseStreamK*:*Dense* (every schedule against the reference, the
#   locks left zero over eager calls and graph replays), then
#   dense_gemm_bench.py --stream-k auto,off,2,3,4 (qkv_a, o_proj, 1 to 256
#   tokens; dense-stream-k.json) and model_bench.py (ep8, batch 64 / 128,
#   q_len 1 and 2) with the setting off and auto, interleaved, two rounds
#   (stream-k-model-*.json).
#   serve-batch128 (not in the default): the same server decoding 128
#   shared-prefix requests of 256 tokens at once (serve-batch128.json).
#   serve-vs-bare (not in the default): model_bench.py's step at 128
#   requests under the server's conditions (model.json), then
#   serve-batch128's load against it (serve-vs-bare.json: vs_bare).
#   serve-switch (not in the default): serve-batch128's load with the
#   server's GIL switch interval at 5000 us (the default) and 500 us
#   (MOELINK_SERVE_SWITCH_INTERVAL_US; serve-switch-*.json).
#   wheel (not in the default): the wheel in .deps/moelink-wheel (built
#   here by tools/build_wheel.sh) installed with pip install --no-deps into
#   a fresh virtual environment; its Python tests on the GPU from there.
#   vllm (not in the default): tests/python/test_vllm_prepare_finalize.py's
#   nvlink cases (ranks sharing the GPU) and plugin test, with vLLM's Python
#   files from .deps (tools/prepare_device_deps.sh).
#   internode: moelink-bench with the internode backend beside nvlink, over
#   libfabric's shm provider (GPUs of this machine treated as nodes).
#   fabric (not in the default): moelink-fabric-bench, the TransferEngine
#   against raw libfabric, yield-when-idle and busy-poll, pinned (rank r on
#   CPU r, its worker on CPU N+1+r; past the CPU set, beside the workers of
#   ranks 2, 3, ...)
#   (MOELINK_FABRIC_BENCH_ARGS replaces the default arguments).
# MOELINK_BUILD_DIR (default build-gpu) is the build tree; one built on the
# CPU machine by tools/build_for_device.sh and carried runs without the
# build step (e.g. MOELINK_BUILD_DIR=build-device bash tools/gpu_check.sh
# test), which saves the device the build's minutes.
# MOELINK_BUILD_TARGETS builds only those targets (e.g. "_C
# moelink_layer_tests"; default: all). MOELINK_CMAKE_ARGS adds configure arguments (e.g.
# -DMOELINK_EXPERTS_TILE_SWEEP=ON for experts_bench.py --tiles).
# Needs .deps/ from tools/prepare_device_deps.sh (that machine has no package
# registry) and carries it with the call.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
steps=${*:-build test python sanitize bench internode experts}
known="build test python sanitize bench internode experts layer model model-sanitize serve serve-batch128
  serve-vs-bare serve-switch serve-rate pd-gpu attention seesaw seesaw-trace head-gemm split-k stream-k vllm wheel fabric"
for s in $steps; do  # a misspelt step would otherwise run nothing and pass
  [[ " $(echo $known) " == *" $s "* ]] || { echo "gpu_check.sh: unknown step '$s' (steps: $(echo $known))" >&2; exit 2; }
done
bdir=${MOELINK_BUILD_DIR:-build-gpu}
source "$root/tools/device_env.sh"
python_build=OFF
{ has python || has experts || has layer || has model || has model-sanitize || has serve || has serve-batch128 || has serve-vs-bare || has serve-switch || has serve-rate || has pd-gpu || has attention || has seesaw || has seesaw-trace || has head-gemm || has split-k || has stream-k || has vllm; } && python_build=ON

if has build; then
  nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -8
  cmake -S . -B $bdir -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMOELINK_GTEST_SOURCE_DIR="$root/.deps/googletest" \
    -DMOELINK_EXTRA_INCLUDE_DIR="$root/.deps/include" \
    -DNCCL_ROOT="$nccl_home" -DNVSHMEM_HOME="$nvshmem_home" \
    -DMOELINK_BUILD_PYTHON=$python_build "${fabric_args[@]}" "${cutlass_args[@]}" "${flashinfer_args[@]}" \
    ${MOELINK_CMAKE_ARGS:-} \
    -DPython_EXECUTABLE="$py" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  grep -E "moelink: (backend|backends|TransferEngine|CUTLASS|FlashInfer)" "$OUT/configure.log"
  cmake --build $bdir -j "$(nproc)" ${MOELINK_BUILD_TARGETS:+--target $MOELINK_BUILD_TARGETS} \
    >"$OUT/build.log" 2>&1 || { grep -B2 -A10 error "$OUT/build.log" | head -60; exit 1; }
  echo "build ok"
fi

# Runs one GoogleTest binary with FI_TCP_IFACE=lo; the log to $OUT, its
# summary lines here. "optional": built only with libfabric, else skipped.
run_gtests() {  # title binary filter log [optional]
  if [[ ! -x $2 ]]; then
    [[ ${5:-} == optional ]] || { echo "== $1: $2 was not built"; status=1; }
    return 0
  fi
  echo "== $1"
  FI_TCP_IFACE=lo "$2" --gtest_filter="$3" >"$OUT/$4" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED" "$OUT/$4" | tail -25
}

if has test; then
  run_gtests "GPU test suite ($ngpu GPUs)" $bdir/tests/moelink_tests \
    "${MOELINK_GTEST_FILTER:-*}" tests.log
  run_gtests "expert kernels (CUDA and CPU)" $bdir/tests/moelink_experts_tests \
    "${MOELINK_EXPERTS_FILTER:-*}" experts-tests.log
  run_gtests "MoE layer (cpu and nvlink backends, ranks sharing the GPUs)" \
    $bdir/tests/moelink_layer_tests "${MOELINK_LAYER_FILTER:-*}" layer-tests.log
  run_gtests "MLA attention (CUDA and CPU paths, FlashInfer's kernels where built)" \
    $bdir/tests/moelink_attention_tests "${MOELINK_ATTENTION_FILTER:-*}" attention-tests.log optional
  run_gtests "the model (CUDA and CPU paths, decode graphs, overlap modes)" \
    $bdir/tests/moelink_model_tests "${MOELINK_MODEL_FILTER:-*}" model-tests.log optional
  run_gtests "TransferEngine GPU tests (a kernel polls signal_on_imm's flag; shm / tcp)" \
    $bdir/src/fabric/tests/moelink_fabric_tests "${MOELINK_FABRIC_FILTER:-*Gpu*}" fabric-tests.log \
    optional
  run_gtests "internode backend tests (GPU and CPU, libfabric shm / tcp)" \
    $bdir/src/fabric/tests/moelink_internode_tests "${MOELINK_INTERNODE_FILTER:-*}" \
    internode-tests.log optional
fi

if has pd-gpu; then
  # P/D hand-off of KV caches in GPU memory: libfabric with FI_HMEM CUDA
  # (tools/build_libfabric_cuda.sh) preloaded in place of the sysroot's.
  echo "== P/D hand-off from GPU memory (libfabric with CUDA, preloaded)"
  lfc=/tmp/moelink-libfabric-cuda
  if [[ -f $root/.deps/libfabric-cuda.tar.xz ]]; then
    mkdir -p $lfc && tar xJf "$root/.deps/libfabric-cuda.tar.xz" -C $lfc
    cudart_dir=$(dirname "$(ls /usr/local/cuda/lib64/libcudart.so* 2>/dev/null | head -1)")
    LD_LIBRARY_PATH="$lfc/lib:$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" FI_LOG_LEVEL=warn \
      $lfc/bin/fi_info -p shm -c FI_HMEM 2>&1 | grep -E "provider|hmem|HMEM" | head -5
    LD_PRELOAD=$lfc/lib/libfabric.so.1 LD_LIBRARY_PATH="$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      FI_TCP_IFACE=lo MOELINK_PYTHONPATH="$root/$bdir/python" \
      $py -m pytest -q -rs tests/python/test_pd_handoff.py -k nvlink >"$OUT/pytest-pd-gpu.log" 2>&1 || status=1
    tail -8 "$OUT/pytest-pd-gpu.log"
    # moelink-serve --engines 2 --pd on the GPU: the scheduler (with gRPC's
    # runtime, .deps/grpc-runtime.tar.xz; grpcio from .deps/pywheels), a
    # prefill and a decode worker sharing the GPU, the openai client.
    if [[ -x $bdir/tools/scheduler/moelink-scheduler ]]; then
      LD_PRELOAD=$lfc/lib/libfabric.so.1 LD_LIBRARY_PATH="$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        FI_TCP_IFACE=lo MOELINK_PYTHONPATH="$root/$bdir/python" MOELINK_BIN_DIR="$root/$bdir/tools/scheduler" \
        $py -m pytest -q -rs tests/python/test_serve_pd.py -k nvlink >"$OUT/pytest-serve-pd-gpu.log" 2>&1 || status=1
      tail -8 "$OUT/pytest-serve-pd-gpu.log"
    else
      echo "no $bdir/tools/scheduler/moelink-scheduler: moelink-serve --pd on the GPU not run"
    fi
  else
    echo "no .deps/libfabric-cuda.tar.xz (tools/build_libfabric_cuda.sh makes it)"; status=1
  fi
fi

if has wheel; then
  echo "== the wheel in .deps/moelink-wheel, installed into a fresh virtual environment"
  venv=/tmp/moelink-wheel-venv
  rm -rf $venv && $py -m venv $venv
  # The image's python3 is itself a virtual environment: --system-site-packages
  # would give its base interpreter's packages, not its torch and pytest.
  echo "$site" >$venv/lib/python3.12/site-packages/image-packages.pth
  $venv/bin/python -m pip install -q --no-deps --no-index --disable-pip-version-check \
    "$root"/.deps/moelink-wheel/moelink-*.whl || status=1
  T=$root/tests/python
  (cd /tmp && env -u MOELINK_PYTHONPATH $venv/bin/python -c 'import moelink, sys
assert moelink.__file__.startswith(sys.prefix), f"moelink came from {moelink.__file__}"
print("moelink", moelink.__version__, "from", moelink.__file__, "cuda:", moelink.with_cuda)' &&
    env -u MOELINK_PYTHONPATH $venv/bin/python -m pytest -q -rs -p no:cacheprovider $T/test_version.py \
      $T/test_binding.py $T/test_torch_ops.py $T/test_experts.py $T/test_mla_attention.py $T/test_moe_layer.py \
      $T/test_model.py $T/test_model_mtp.py $T/test_engine.py >"$OUT/pytest-wheel.log" 2>&1) || status=1
  tail -4 "$OUT/pytest-wheel.log"
fi

if has vllm; then
  echo "== vLLM's modular kernel with moelink's prepare/finalize on nvlink (vLLM's Python files from .deps)"
  if [[ -n ${vllm_src:-} ]]; then
    PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$vllm_src" MOELINK_PYTHONPATH="$root/$bdir/python" \
      $py -m pytest -q -rs -p no:cacheprovider tests/python/test_vllm_prepare_finalize.py -k "nvlink or plugin" \
      >"$OUT/pytest-vllm.log" 2>&1 || status=1
    tail -4 "$OUT/pytest-vllm.log"
  else
    echo "no .deps/vllm-*-py.tar.xz (tools/prepare_device_deps.sh packs it)"; status=1
  fi
fi

if has python; then
  echo "== Python binding tests (torch)"
  MOELINK_PYTHONPATH="$root/$bdir/python" $py -m pytest -q -rs tests/python >"$OUT/pytest.log" 2>&1 || status=1
  tail -5 "$OUT/pytest.log"
fi

if has sanitize; then
  echo "== compute-sanitizer (memcheck, racecheck) on the small GPU cases"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --target-processes all --error-exitcode 9 \
      $bdir/tests/moelink_tests --gtest_filter="${MOELINK_SANITIZE_FILTER:-GpuAllToAll.Small*}" \
      >"$OUT/sanitizer-$tool.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitizer-$tool.log" | tail -6
  done
  echo "== compute-sanitizer memcheck on the MoE layer (one small case per mode, world 2)"
  compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
    $bdir/tests/moelink_layer_tests \
    --gtest_filter="${MOELINK_LAYER_SANITIZE_FILTER:-*GpuMoELayer*DeepSeekLike_W2_*}" \
    >"$OUT/sanitizer-layer-memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitizer-layer-memcheck.log" | tail -6
  echo "== compute-sanitizer memcheck on the expert kernels (small cases, graph replay, errors)"
  compute-sanitizer --tool memcheck --error-exitcode 9 $bdir/tests/moelink_experts_tests \
    --gtest_filter="${MOELINK_EXPERTS_SANITIZE_FILTER:-*GpuExperts*Small*:*GpuExpertsDense*:*GpuExpertsErrors*:*GpuExpertsGraph*}" \
    >"$OUT/sanitizer-experts-memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitizer-experts-memcheck.log" | tail -6
fi

if has bench; then
  echo "== moelink-bench"
  cmd=($bdir/tools/bench/moelink-bench --nproc "$ngpu" --machine "$machine"
       --json "$OUT/bench.json" ${MOELINK_BENCH_ARGS:-})
  echo "${cmd[*]}"
  "${cmd[@]}" 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1
fi
if has internode; then
  echo "== moelink-bench: internode (libfabric shm, host staging) beside nvlink"
  np=${MOELINK_BENCH_NPROC:-$(( ngpu > 2 ? ngpu : 2 ))}
  cmd=($bdir/tools/bench/moelink-bench --nproc "$np" --backend internode --compare nvlink
       --fabric-provider shm --machine "$machine" --json "$OUT/bench-internode.json"
       ${MOELINK_INTERNODE_BENCH_ARGS:-})
  echo "${cmd[*]}"
  "${cmd[@]}" 2>&1 | tee "$OUT/bench-internode.log" | tail -45 || status=1
fi
if has experts; then
  echo "== expert kernels: tools/bench/experts_bench.py"
  cmd=($py tools/bench/experts_bench.py --machine "$machine" --json "$OUT/experts.json"
       ${MOELINK_EXPERTS_BENCH_ARGS:-})
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 | tee "$OUT/experts-bench.log" | tail -30 ||
    status=1
fi
if has layer; then
  echo "== MoE layer: tools/bench/layer_bench.py"
  cmd=($py tools/bench/layer_bench.py --machine "$machine" --json "$OUT/layer.json"
       ${MOELINK_LAYER_BENCH_ARGS:-})
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 | tee "$OUT/layer-bench.log" | tail -40 ||
    status=1
  # One EP8 rank's stand-in (32 of the 256 experts): calibrates moelink-plan's EP8 layout in the model step.
  cmd=($py tools/bench/layer_bench.py --machine "$machine" --experts 32 --modes none
       --batches 1,2,4,8,16,32,64,128,256 --json "$OUT/layer-ep8-rank.json")
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 | tee "$OUT/layer-ep8-rank.log" |
    tail -12 || status=1
  # The attention step of every layer (128 heads, the model step's kv 5000): calibrates moelink-plan's attention.
  cmd=($py tools/bench/attention_bench.py --machine "$machine" --heads 128 --batch 1,2,4,8,16,32,64,128
       --q-len 1,2 --kv 5000 --step-kernels --json "$OUT/attention-steps.json")
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 |
    tee "$OUT/attention-steps.log" | grep -E "^heads" || status=1
fi
if has model; then
  echo "== the model's decode step: tools/bench/model_bench.py"
  cmd=($py tools/bench/model_bench.py --machine "$machine" --plan $bdir/tools/plan/moelink-plan
       --json "$OUT/model.json" --svg "$OUT/model.svg" ${MOELINK_MODEL_BENCH_ARGS:-})
  # The layer step's run, where it ran first, calibrates moelink-plan (where it applies: one rank).
  [[ -f $OUT/layer.json ]] && cmd+=(--plan-calibrate "$OUT/layer.json")
  [[ -f $OUT/layer-ep8-rank.json ]] && cmd+=(--plan-calibrate "$OUT/layer-ep8-rank.json")
  [[ -f $OUT/attention-steps.json ]] && cmd+=(--plan-calibrate "$OUT/attention-steps.json")
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 |
    tee "$OUT/model-bench.log" | tail -40 || status=1
fi
if has model-sanitize; then
  echo "== compute-sanitizer memcheck over the model's graphed decode steps (model_bench.py)"
  cmd=(compute-sanitizer --tool memcheck --print-limit 30 --error-exitcode 9 $py tools/bench/model_bench.py
       ${MOELINK_MODEL_SANITIZE_ARGS:---shapes ep8 --moe-layers 1 --iters 1 --profile-batches 0}
       --machine "$machine" --json "$OUT/model-sanitize.json")
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" \
    >"$OUT/sanitizer-model-memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|Invalid|Device Frame|model_bench:   B" "$OUT/sanitizer-model-memcheck.log" | cut -c1-240 | head -40
fi
serve_bench() {  # name args...: serve_bench.py on the full-width EP8-shaped model into $OUT/name.json
  local name=$1; shift
  local model=/dev/shm/moelink-serve-bench-ep8
  [[ -f $model/tokenizer.json ]] || PYTHONPATH="$root/$bdir/python" \
    $py -m moelink.serve.tiny_model "$model" --full-width --layers 5 --experts 32 || status=1
  cmd=($py tools/bench/serve_bench.py --model "$model" --machine "$machine" --json "$OUT/$name.json"
       --svg "$OUT/$name.svg"
       --server-log "$OUT/$name-server.log"
       --serve-args "--backend nvlink --cuda-graphs --num-pages 12000 --page-size 64 --max-running 128 --token-budget 4096"
       "$@")
  [[ -f $OUT/model.json ]] && cmd+=(--model-bench "$OUT/model.json")
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 |
    tee "$OUT/$name-bench.log" | tail -40 || status=1
}
if has serve; then
  echo "== moelink-serve under load: tools/bench/serve_bench.py"
  serve_bench serve ${MOELINK_SERVE_BENCH_ARGS:---requests 64 --concurrency 1,16,64 --max-tokens 64}
fi
if has attention; then
  echo "== MLA decode: moelink, FlashInfer, FlashMLA (tools/bench/attention_bench.py)"
  fm=()
  PYTHON=$py bash tools/build_flashmla.sh /tmp/moelink-flashmla && fm=(--flashmla /tmp/moelink-flashmla) || status=1
  cmd=($py tools/bench/attention_bench.py --machine "$machine" --json "$OUT/attention.json" "${fm[@]}"
       --qkv-a 1,8,32,64,128,256 --bmm 1,8,32,64,128,256 ${MOELINK_ATTENTION_BENCH_ARGS:-})
  echo "${cmd[*]}"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 |
    tee "$OUT/attention-bench.log" | tail -40 || status=1
fi
if has split-k; then
  echo "== dense GEMMs split over K (MOELINK_EXPERTS_SPLIT_K: ${MOELINK_SPLIT_K_SETTINGS:-1 auto})"
  run_gtests "expert kernels: split over K, dense GEMMs" $bdir/tests/moelink_experts_tests \
    '*SplitK*:*Dense*' split-k-tests.log
  for round in 1 2; do
    for split in ${MOELINK_SPLIT_K_SETTINGS:-1 auto}; do
      MOELINK_EXPERTS_SPLIT_K=$split PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
        $py tools/bench/attention_bench.py --machine "$machine" --heads "" --qkv-a 1,32,64,128,256 --iters 20 \
        --json "$OUT/split-k-qkv-a-$split-r$round.json" 2>&1 | grep -E "^qkv_a" || status=1
      MOELINK_EXPERTS_SPLIT_K=$split PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
        $py tools/bench/model_bench.py --machine "$machine" --shapes ep8 --batches 1,32,128 --q-lens 1 \
        --profile-batches 0 --json "$OUT/split-k-model-$split-r$round.json" 2>&1 | tail -4 || status=1
    done
  done
fi
if has stream-k; then
  echo "== the dense GEMM split over K in one kernel (MOELINK_EXPERTS_STREAM_K)"
  run_gtests "expert kernels: the dense GEMMs, split in one kernel" $bdir/tests/moelink_experts_tests \
    '*DenseStreamK*:*Dense*' stream-k-tests.log
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
    $py tools/bench/dense_gemm_bench.py --machine "$machine" --shapes qkv_a,o_proj --m 1,32,64,65,128,256 \
    --stream-k auto,off,2,3,4 --json "$OUT/dense-stream-k.json" 2>&1 | grep -E "^(qkv_a|o_proj)" || status=1
  for round in 1 2; do
    for setting in off auto; do
      MOELINK_EXPERTS_STREAM_K=$setting PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
        $py tools/bench/model_bench.py --machine "$machine" --shapes ep8 --batches 64,128 --q-lens 1,2 \
        --profile-batches 0 --json "$OUT/stream-k-model-$setting-r$round.json" 2>&1 | tail -4 || status=1
    done
  done
fi
if has seesaw; then
  echo "== moelink's out-of-step (seesaw) decode kernel: tests, then against the lockstep kernel"
  MOELINK_MLA_DECODE_SEESAW=1 timeout 300 $bdir/tests/moelink_attention_tests \
    --gtest_filter='*Own*:*Cuda*Decode*:*Graph*' >"$OUT/seesaw-tests.log" 2>&1
  rc=$?
  grep -E "^\[ +(RUN|OK|FAILED|PASSED) |measured|Failure" "$OUT/seesaw-tests.log" | tail -40
  if [[ $rc == 0 ]]; then
    for round in 1 2; do
      for k in 0 1; do
        MOELINK_MLA_DECODE_SEESAW=$k PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
          $py tools/bench/attention_bench.py --machine "$machine" --heads 128 --batch 1,32,128 --q-len 1 --kv 5000 \
          --iters 20 --json "$OUT/decode-seesaw$k-r$round.json" 2>&1 | tail -4 || status=1
      done
    done
  else
    echo "seesaw tests: exit $rc (124: the 300 s timeout; the log's last RUN names the test)"; status=1
  fi
fi
seesaw_trace() {  # name: the seesaw kernel's stamps at 128 requests of 128 heads -> $OUT/name.txt (env passes through)
  local clock
  clock=$(nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits | head -1)
  MOELINK_MLA_DECODE_SEESAW_TRACE="$OUT/$1" PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" \
    $py tools/bench/attention_bench.py --machine "$machine" --heads 128 --batch 128 --q-len 1 --kv 5000 --iters 3 \
    --json "$OUT/$1-bench.json" 2>&1 | grep -E "^heads|trace" || status=1
  $py tools/bench/seesaw_trace_report.py "$OUT/$1" --clock-mhz "${clock:-1980}" | tee "$OUT/$1.txt" || status=1
}
if has seesaw-trace; then
  echo "== the seesaw decode kernel's phases (SeesawTrace)"
  seesaw_trace seesaw-trace
fi
if has head-gemm; then
  echo "== MLA head GEMMs: bf16 (cuBLAS) against fp8 (grouped GEMM)"
  $bdir/tests/moelink_attention_tests --gtest_filter='*HeadGemm*' --gtest_brief=1 2>&1 |
    tee "$OUT/head-gemm-tests.log" | tail -6 || status=1
  for round in 1 2; do
    for g in bf16 fp8; do
      PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" $py tools/bench/attention_bench.py \
        --machine "$machine" --heads 128,16 --batch 1,32,128 --q-len 1,2 --kv 5000 --head-gemm $g --step-kernels \
        --json "$OUT/head-gemm-attention-$g-r$round.json" 2>&1 | grep -E "^heads|^  moelink step" || status=1
      PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" $py tools/bench/model_bench.py \
        --machine "$machine" --shapes ep8 --batches 1,32,128 --q-lens 1,2 --profile-batches 0 --head-gemm $g \
        --json "$OUT/head-gemm-model-$g-r$round.json" 2>&1 | tail -8 || status=1
    done
  done
fi
if has serve-rate; then
  echo "== moelink-serve under Poisson arrivals: 2, 8 and 32 requests/s"
  serve_bench serve-rate --rate 2,8,32 --requests 64 --concurrency 64 --max-tokens 64 \
    --traces shared-prefix,multi-turn --cache on
fi
if has serve-batch128; then
  echo "== moelink-serve decoding 128 requests at once (issue 35's batch-128 rate against the bare step)"
  serve_bench serve-batch128 --traces shared-prefix --cache on --requests 128 --concurrency 128 --max-tokens 256
fi
if has serve-vs-bare; then
  # Issue 35's batch-128 target side by side: the bare step under the
  # server's conditions (its contexts, scattered pages, its token budget as
  # max_tokens), then the server decoding 128 requests against it.
  echo "== the bare step under the server's conditions, then moelink-serve decoding 128 requests"
  PYTHONPATH="$root/$bdir/python:$root/tools/bench${PYTHONPATH:+:$PYTHONPATH}" $py tools/bench/model_bench.py \
    --machine "$machine" --shapes ep8 --batches 128 --q-lens 1 --profile-batches 0 --kv-spread 256 \
    --shuffle-pages --max-tokens 4096 --json "$OUT/model.json" 2>&1 | tail -4 || status=1
  serve_bench serve-vs-bare --traces shared-prefix --cache on --requests 128 --concurrency 128 --max-tokens 256
fi
if has serve-switch; then
  # The server's GIL switch interval (set_switch_interval), 5000 us (the
  # default) against 500 us, on serve-batch128's load: how long the engine
  # thread waits for the GIL after each step while 128 handler threads stream.
  for us in 5000 500; do
    echo "== moelink-serve, 128 requests, MOELINK_SERVE_SWITCH_INTERVAL_US=$us"
    MOELINK_SERVE_SWITCH_INTERVAL_US=$us serve_bench serve-switch-$us --traces shared-prefix --cache on \
      --requests 128 --concurrency 128 --max-tokens 256
  done
fi
if has fabric; then
  for mode in yield busy-poll; do
    echo "== moelink-fabric-bench ($mode)"
    extra=(); [[ $mode == busy-poll ]] && extra=(--busy-poll)
    cmd=($bdir/src/fabric/fabric_bench/moelink-fabric-bench
         ${MOELINK_FABRIC_BENCH_ARGS:---provider shm,tcp --peers 2,4,8 --lat-iters 1000 --rate-iters 2000 --rounds 6 --pin}
         "${extra[@]}" --json "$OUT/fabric-$mode.json")
    echo "${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$OUT/fabric-$mode.log" | tail -22 || status=1
  done
fi
exit $status
