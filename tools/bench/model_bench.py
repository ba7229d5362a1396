#!/usr/bin/env python3
"""moelink-model-bench: a DeepSeek-V3 model's decode step (moelink.Model)
on this machine's GPU, at full width with random fp8 weights.

Shapes (--shapes):
  ep8     what one GPU of an EP8 deployment runs: 32 local experts receiving
          what an EP8 rank receives (top-8 of 32 in 8 groups, so each expert
          gets batch x 8 / 32 rows, as each of an EP8 rank's 32 experts does
          from 8 ranks' batches at top-8 of 256); a local stand-in: the
          dispatch and combine are the NVLink backend's kernels at world 1
          (local copies), no NVLink transfer;
  world1  all 256 experts on this GPU, world 1.
Each: first_k_dense_replace (3) dense layers and --moe-layers MoE layers of
DeepSeek-V3's widths (the checkpoint written once into --checkpoint-dir by
moelink.serve.tiny_model.write_fp8_checkpoint; the MTP module is left out:
q_len 2 steps verify a draft row, the MTP module's own layer is one more
MoE layer and head on top).

For each batch B (requests, each decoding on a --kv token context) and
q_len (1, or 2: a draft row verified, ModelOptions' speculative step):
  graph_us         the decode step as the serving engine runs it:
                   Model.step_from_host with decode_graphs (the batch's
                   bucket replayed; host copies in and out included), host
                   wall time, median of --iters steps, each step's
                   contexts a token longer than the last's (FlashInfer's
                   plan runs every step, as in serving) and Model.check
                   after each (the engine's reading of the step's error
                   records; check_us times it alone); graph_replays and
                   eager_steps say how those steps ran (Model's
                   decode_graph_stats: a batch FlashInfer schedules on
                   another grid than the captured one runs eagerly);
                   graph_host_us / graph_wait_us: those steps' host clock
                   (means) until their work is queued / after (the
                   server's decode step has the same split);
  eager_us         Model.step on device tensors, no graph (CUDA events; the
                   FlashInfer plan reads the lengths back once a layer);
  layer_us         the step split by layer kind, from models of 1, 3 and
                   3 + M layers on the same checkpoint (graph_us
                   differences): "dense" and "moe" per layer, "rest" the
                   embedding, final norm, lm_head and sampling;
  device_mib       (per shape) the device memory of each model depth, and
                   what one more dense or MoE layer adds (its weights and
                   KV cache: the layers of a kind share one scratch);
  tokens_per_s     output tokens per second of this GPU: B x (1 + the
                   accepted drafts, --acceptance of them at q_len 2) per
                   graph_us;
  kernels          with --profile-batches: the graphed step's kernels from
                   torch.profiler (sum_of_kernels_us, busy_us: the "no
                   gaps" bound graph_us is held to; by name, us and
                   exclusive_us, and by kind, exclusive: each busy instant
                   counted once, benchlib.exclusive_us);
  floor_us         a MoE layer's floor: every weight and KV byte it reads at
                   the device-copy bandwidth this process measures, or its
                   FLOPs at the measured dense fp8 peak, whichever is larger
                   (the routed experts counted as expected under uniform
                   routing); moe_serial_floor_us: the same layer's
                   kernels one after another, each at its own floor (the
                   attention kernel's bf16 math at the measured bf16 peak,
                   the fp8 weights' GEMMs at the fp8 peak): the least a
                   layer whose kernels do not overlap can take;
  host_us_per_layer  the host time before the replay (graph_host_us) that
                   one more dense or MoE layer adds: the 3-layer model's
                   less the 1-layer one's over 2, the full model's less the
                   3-layer one's over --moe-layers (means of --iters steps);
  plan_us          with --plan: moelink-plan's prediction of the same layer
                   kinds for this layout (EP8 or EP1, TP1, the batch, kv,
                   q_len) on the GPU's profile (--plan-gpu; by default the
                   one this GPU's name names), calibrated by --plan-calibrate's
                   files where they apply; plan_over_measured: its MoE and
                   dense layers over the measured ones.

    PYTHONPATH=build-gpu/python python3 tools/bench/model_bench.py \\
        --plan build-gpu/tools/plan/moelink-plan --json model.json

--tiny --backend cpu runs the same on the tiny model's widths on the CPU
path (the benchmark's own test; no GPU numbers).
"""
import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import moelink
from benchlib import free_port, header, write_json
from moelink.serve.tiny_model import DEEPSEEK_V3, TINY, write_fp8_checkpoint

HOST_BACKENDS = ("cpu", "internode-cpu")


def shape_fields(shape, moe_layers, tiny):
    """The checkpoint's config fields of a shape."""
    base = dict(TINY, rope_scaling=None, first_k_dense_replace=2) if tiny else dict(DEEPSEEK_V3)
    base.update(num_nextn_predict_layers=0,
                num_hidden_layers=base["first_k_dense_replace"] + moe_layers)
    if shape == "ep8":
        base.update(n_routed_experts=base["n_routed_experts"] // 8 if not tiny else 8, n_group=4 if tiny else 8,
                    topk_group=2 if tiny else 4)
    elif shape != "world1":
        raise SystemExit(f"model_bench: --shapes: unknown shape {shape!r} (ep8, world1)")
    return base


def checkpoint(root, shape, fields, seed):
    """The shape's checkpoint directory, written unless one of the same
    config is there already."""
    d = os.path.join(root, f"{shape}-{fields['num_hidden_layers']}layers-{fields['hidden_size']}")
    cfg = os.path.join(d, "config.json")
    if os.path.exists(cfg) and os.path.exists(os.path.join(d, "model.safetensors.index.json")):
        with open(cfg) as f:
            old = json.load(f)
        if all(old.get(k) == v for k, v in fields.items()):
            return d
    os.makedirs(d, exist_ok=True)
    t0 = time.time()
    print(f"model_bench: writing a random fp8 checkpoint ({shape}, {fields['num_hidden_layers']} layers) "
          f"into {d}", file=sys.stderr, flush=True)
    write_fp8_checkpoint(d, fields, seed)
    print(f"model_bench: written in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return d


class Timer:
    """Step timing on the device (CUDA events, torch) or the host."""

    def __init__(self, gpu):
        self.gpu = gpu
        if gpu:
            import torch
            self.torch = torch

    def host_us(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def device_us(self, fn, iters, warmup):
        from benchlib import median_event_us
        return median_event_us(fn, iters, warmup)


def device_used_bytes():
    """Device memory in use on this GPU (every process's), after the queue drains."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch's cached blocks are not the model's
    free, total = torch.cuda.mem_get_info()
    return total - free


def make_model(a, fields, ckpt, num_layers, max_b, max_q):
    """The model of num_layers layers, loaded; its pages a request; the device
    memory it took (weights, KV cache and scratch; None on the CPU path)."""
    pages_per_request = math.ceil((a.kv + a.kv_spread + max_q + KV_GROWTH) / a.page_size)
    gpu = a.backend not in HOST_BACKENDS
    before = device_used_bytes() if gpu else None
    m = moelink.Model(os.path.join(ckpt, "config.json"), backend=a.backend, max_tokens=a.max_tokens,
                      num_pages=max_b * pages_per_request, page_size=a.page_size, max_requests=max_b,
                      max_pages_per_request=pages_per_request, num_layers=num_layers,
                      overlap=a.overlap, decode_graphs=a.backend not in HOST_BACKENDS, head_gemm=a.head_gemm,
                      decode_kernel=a.decode_kernel,
                      bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 60.0))
    t0 = time.time()
    m.load_checkpoint(ckpt)
    print(f"model_bench: {num_layers} layers loaded in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    region = m.kv_cache_region()
    if gpu:  # a context of random values, not zeros
        region.view(__import__("torch").bfloat16).normal_()
    used = (device_used_bytes() - before) if gpu else None
    if used is not None:
        print(f"model_bench: {num_layers} layers take {used / 2**20:.0f} MiB of device memory", file=sys.stderr,
              flush=True)
    return m, pages_per_request, used


KV_GROWTH = 32  # graph_us's steps: contexts kv + q .. kv + q + KV_GROWTH - 1 tokens


def step_inputs(fields, b, q, kv, pages_per_request, seed, same_token=False, kv_spread=0, shuffle_pages=False):
    """Host arrays of a decode step of b requests of q rows on kv-token contexts
    (same_token: every row the same token id; kv_spread: request i's context
    kv + i * kv_spread // (b - 1) tokens, as a server's batch of requests
    that started apart; shuffle_pages: the requests' pages dealt from a
    random order of the pool, as a server's cache hands them out)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, fields["vocab_size"], 1 if same_token else b * q)
    pages = rng.permutation(b * pages_per_request) if shuffle_pages else np.arange(b * pages_per_request)
    return dict(token_ids=np.resize(ids, b * q).astype(np.int32),
                q_start=(np.arange(b + 1) * q).astype(np.int32),
                kv_len=(kv + q + np.arange(b) * kv_spread // max(b - 1, 1)).astype(np.int32),
                block_table=pages.astype(np.int32).reshape(b, pages_per_request),
                num_drafts=np.full(b, q - 1, np.int32) if q > 1 else None,
                next_tokens=np.zeros(b, np.int32),
                accepted=np.zeros(b, np.int32) if q > 1 else None)


def time_model(a, timer, model, fields, ppr, full, cells):
    """graph_us (and, on the full model, eager_us and kernels) per cell."""
    out = {}
    for b, q in cells:
        x = step_inputs(fields, b, q, a.kv, ppr, a.seed + b, a.same_token, a.kv_spread, a.shuffle_pages)

        steps = [0]

        def from_host():
            # As in serving, each step's contexts are a token longer than the
            # last one's (wrapping every KV_GROWTH steps): the attention's
            # FlashInfer plan runs every step, as a server's does.
            kv_len = x["kv_len"] + steps[0] % KV_GROWTH
            steps[0] += 1
            model.step_from_host(x["token_ids"], x["q_start"], kv_len, x["block_table"], x["next_tokens"],
                                 num_decode=b, num_drafts=x["num_drafts"], accepted=x["accepted"])
            model.check()  # the engine reads the step's error records after every step

        for _ in range(3):  # the bucket's eager step, its capture, a replay
            from_host()
        s0 = model.decode_graph_stats
        r = {"graph_us": timer.host_us(from_host, a.iters, warmup=0)}
        s1 = model.decode_graph_stats
        # Which steps were timed: replays of the bucket's graph, or eager ones
        # (the CPU path, or a batch FlashInfer schedules on another grid).
        r["graph_replays"] = s1["replays"] - s0["replays"]
        r["eager_steps"] = s1["eager_steps"] - s0["eager_steps"]
        # Their host clock split at the launch (means; set against a server's).
        timed = max(1, r["graph_replays"] + r["eager_steps"])
        r["graph_host_us"] = (s1["host_seconds"] - s0["host_seconds"]) / timed * 1e6
        r["graph_wait_us"] = (s1["wait_seconds"] - s0["wait_seconds"]) / timed * 1e6
        r["check_us"] = timer.host_us(model.check, a.iters, warmup=1)  # its part of graph_us
        if full and timer.gpu:
            torch = timer.torch
            d = {k: (torch.from_numpy(v).cuda() if v is not None else None) for k, v in x.items()}

            def eager():
                model.step(d["token_ids"], d["q_start"], d["kv_len"], d["block_table"], d["next_tokens"],
                           num_decode=b, num_drafts=d["num_drafts"], accepted=d["accepted"])

            r["eager_us"] = timer.device_us(eager, a.iters, warmup=2)
            if b in a.profile_batches:
                r["kernels"] = profile_kernels(from_host, a.profile_iters)
        out[(b, q)] = r
        print(f"model_bench:   B {b:4d} q {q}  graph {r['graph_us']:9.1f} us "
              f"({r['graph_replays']} replayed, {r['eager_steps']} eager, host {r['graph_host_us']:.0f} + wait "
              f"{r['graph_wait_us']:.0f} us, check {r['check_us']:.0f} us)" +
              (f"  eager {r['eager_us']:9.1f} us" if "eager_us" in r else ""), file=sys.stderr, flush=True)
    return out


# Kernel kinds of a step, by name (first match wins).
KERNEL_KINDS = [
    ("gemm", ("experts::(anonymous namespace)::split_reduce",)),  # the GEMMs' split-K sum, not the decode's
    ("attention", ("decode_attention", "mla", "MLA", "prefill_", "merge_heads", "split_reduce", "split_heads",
                   "gather_kv")),
    ("rope+append", ("rope_q", "append_kv")),
    ("norm", ("rms_norm",)),
    ("dispatch+combine", ("dispatch", "combine")),
    ("gemm", ("gemm", "Gemm", "cutlass", "xmma", "sm90", "nvjet")),
    ("quant", ("quant",)),
    ("router", ("router",)),
    ("embed+sampling", ("sample", "accept_drafts", "plan_step", "embed", "step_rows")),
]


def kernel_kind(name):
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def profile_kernels(fn, iters):
    from layer_bench import kernel_profile
    k = kernel_profile(fn, iters, by_stage=False)
    if k is None:
        return None
    by_kind = {}
    for e in k["kernels"]:  # exclusive times: they add up to busy_us (benchlib.exclusive_us)
        kind = kernel_kind(e["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + e["exclusive_us"]
    k["by_kind_us"] = by_kind
    k["kernels"] = k["kernels"][:30]
    return k


def moe_layer_bytes_flops(fields, b, q, kv):
    """A MoE decoder layer's reads and FLOPs, split into its attention
    kernel's (the bf16 latent cache; scores over 576 dims, output over 512)
    and its fp8 weights' (the projections, the router, the shared and the
    expected touched routed experts): (weight_bytes, weight_flops,
    kv_bytes, attention_flops)."""
    D, H, Rq, R, Im = (fields[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                           "moe_intermediate_size"))
    E, k = fields["n_routed_experts"], fields["num_experts_per_tok"]
    n = b * q
    attn_w = D * (Rq + R + 64) + Rq * H * 192 + R * H * 256 + H * 128 * D  # fp8 bytes = parameters
    expert_w = 3 * D * Im
    touched = E * (1 - (1 - k / E) ** n)
    weight_bytes = attn_w + (touched + fields["n_shared_experts"]) * expert_w + E * D * 2
    weight_flops = 2 * n * (attn_w + (k + fields["n_shared_experts"]) * expert_w)
    kv_bytes = b * (kv + q) * (R + 64) * 2
    attention_flops = 2 * n * H * (kv + q) * (2 * R + 64)
    return weight_bytes, weight_flops, kv_bytes, attention_flops


def moe_layer_floor_us(fields, b, q, kv, copy_gbs, fp8_tflops):
    """A MoE decoder layer's floor (docstring above), us: (floor, bytes, FLOPs)."""
    wb, wf, kvb, af = moe_layer_bytes_flops(fields, b, q, kv)
    bytes_, flops = wb + kvb, wf + af
    return max(bytes_ / (copy_gbs * 1e9) * 1e6, flops / (fp8_tflops * 1e12) * 1e6), bytes_, flops


def moe_layer_serial_floor_us(fields, b, q, kv, copy_gbs, fp8_tflops, bf16_tflops):
    """The same layer with its kernels one after another, each at its own
    floor: the attention kernel at the larger of its cache bytes at the copy
    bandwidth and its FLOPs at the bf16 peak (its math is bf16), plus the
    weights' GEMMs at the larger of their bytes and their FLOPs at the fp8
    peak, us. No layer whose kernels do not overlap can run below it."""
    wb, wf, kvb, af = moe_layer_bytes_flops(fields, b, q, kv)
    bw = copy_gbs * 1e9
    return (max(kvb / bw, af / (bf16_tflops * 1e12)) + max(wb / bw, wf / (fp8_tflops * 1e12))) * 1e6


# moelink-plan's GPU profiles, by the name torch gives the device.
PLAN_GPUS = {"H100": "h100", "H200": "h200", "H800": "h800"}


def plan_gpu_of(device_name):
    """The moelink-plan profile of a device name ("NVIDIA H100 80GB HBM3" -> h100), or None."""
    for key, profile in PLAN_GPUS.items():
        if key in (device_name or ""):
            return profile
    return None


def plan_us(plan_bin, gpu, calibrations, shape, b, q, kv, acceptance):
    """moelink-plan's per-layer-kind prediction (us), or None."""
    cmd = [plan_bin, "--model", "deepseek-v3", "--gpu", gpu, "--ep", "8" if shape == "ep8" else "1",
           "--tp", "1", "--batch", str(b), "--kv-len", str(kv), "--mtp", str(q - 1), "--acceptance",
           str(acceptance), "--overlap", "dispatch", "--ignore-memory", "--json", "-"]
    for f in calibrations:
        cmd += ["--calibrate", f]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"model_bench: {' '.join(cmd)} failed: {res.stderr.strip()}", file=sys.stderr)
        return None
    if res.stderr.strip():  # e.g. a calibration file that does not apply to the layout
        print(f"model_bench: moelink-plan: {res.stderr.strip()}", file=sys.stderr)
    j = json.loads(res.stdout)
    return {"moe": j["moe_layer"]["total_us"], "dense": j.get("dense_layer", {}).get("total_us"),
            "head": j["head_us"], "step": j["step_us"], "gpu": gpu, "notes": res.stderr.strip(),
            "command": " ".join(cmd)}


def run_shape(a, timer, shape, rec):
    fields = shape_fields(shape, a.moe_layers, a.tiny)
    ckpt = checkpoint(a.checkpoint_dir, shape, fields, a.seed)
    K = fields["first_k_dense_replace"]
    cells = [(b, q) for q in a.q_lens for b in a.batches]
    max_b, max_q = max(a.batches), max(a.q_lens)
    times, device_bytes = {}, {}
    for layers in (1, K, K + a.moe_layers):
        print(f"model_bench: {shape}: {layers} layers", file=sys.stderr, flush=True)
        model, ppr, device_bytes[layers] = make_model(a, fields, ckpt, layers, max_b, max_q)
        times[layers] = time_model(a, timer, model, fields, ppr, layers == K + a.moe_layers, cells)
        del model
        gc.collect()
    results = []
    for b, q in cells:
        full = times[K + a.moe_layers][(b, q)]
        t1, tk = times[1][(b, q)]["graph_us"], times[K][(b, q)]["graph_us"]
        dense = (tk - t1) / (K - 1)
        moe = (full["graph_us"] - tk) / a.moe_layers
        r = {"batch": b, "q_len": q, **full,
             "layer_us": {"dense": dense, "moe": moe, "rest": t1 - dense},
             # The host time one more layer adds before the replay (its
             # part of the graph's launch; the plans are made once a batch).
             "host_us_per_layer": {
                 "dense": (times[K][(b, q)]["graph_host_us"] - times[1][(b, q)]["graph_host_us"]) / (K - 1),
                 "moe": (full["graph_host_us"] - times[K][(b, q)]["graph_host_us"]) / a.moe_layers},
             "full_depth": full_depth(a, fields),
             "step_us_full_depth": t1 - dense + K * dense + (full_depth(a, fields) - K) * moe,
             "tokens_per_s": b * (1 + a.acceptance * (q - 1)) / (full["graph_us"] * 1e-6)}
        r["tokens_per_s_full_depth"] = b * (1 + a.acceptance * (q - 1)) / (r["step_us_full_depth"] * 1e-6)
        if "copy_gbs" in rec:
            f, nbytes, flops = moe_layer_floor_us(fields, b, q, a.kv, rec["copy_gbs"], rec["dense_fp8_tflops"])
            r["moe_floor_us"], r["moe_floor_bytes"], r["moe_floor_flops"] = f, nbytes, flops
            r["moe_over_floor"] = moe / f
            r["moe_serial_floor_us"] = moe_layer_serial_floor_us(fields, b, q, a.kv, rec["copy_gbs"],
                                                                 rec["dense_fp8_tflops"], rec["bf16_tflops"])
            r["moe_over_serial_floor"] = moe / r["moe_serial_floor_us"]
        if a.plan and not a.tiny:
            p = r["plan_us"] = plan_us(a.plan, a.plan_gpu, a.plan_calibrate, shape, b, q, a.kv, a.acceptance)
            if p:
                r["plan_over_measured"] = {k: p[k] / r["layer_us"][k] for k in ("moe", "dense")
                                           if p.get(k) and r["layer_us"].get(k)}
        results.append(r)
    out = {"shape": shape, "fields": {k: v for k, v in fields.items() if k != "rope_scaling"},
           "checkpoint": ckpt, "models_layers": [1, K, K + a.moe_layers], "results": results}
    if device_bytes[1] is not None:
        # The models' device memory (weights, KV caches, scratch) and what
        # one more layer of each kind adds: its weights and KV cache (the
        # scratch is shared by the layers of a kind).
        mib = {n: b / 2**20 for n, b in device_bytes.items()}
        out["device_mib"] = {str(n): v for n, v in mib.items()}
        out["device_mib_per_layer"] = {"dense": (mib[K] - mib[1]) / (K - 1),
                                       "moe": (mib[K + a.moe_layers] - mib[K]) / a.moe_layers}
    return out


def full_depth(a, fields):
    """The layers of the whole model the step is extrapolated to: DeepSeek-V3's
    61 at full width, the checkpoint's own with --tiny."""
    return fields["num_hidden_layers"] if a.tiny else DEEPSEEK_V3["num_hidden_layers"]


def print_table(shape_rec):
    print(f"\n{shape_rec['shape']}: per-layer times from models of {shape_rec['models_layers']} layers "
          "(graph_us differences); us")
    print(f"{'B':>5} {'q':>2} {'graph':>9} {'eager':>9} {'dense':>8} {'moe':>8} {'rest':>8} {'floor':>8} "
          f"{'moe/fl':>6} {'serial':>8} {'moe/se':>6} {'host/L':>6} {'plan moe':>8} {'busy':>9} {'tok/s full':>11}")
    for r in shape_rec["results"]:
        lu, p, k = r["layer_us"], r.get("plan_us") or {}, r.get("kernels") or {}

        def f(v, w=8, d=1):
            return format(v, f"{w}.{d}f") if isinstance(v, (int, float)) else " " * (w - 1) + "-"
        print(f"{r['batch']:5d} {r['q_len']:2d} {f(r['graph_us'], 9)} {f(r.get('eager_us'), 9)} {f(lu['dense'])} "
              f"{f(lu['moe'])} {f(lu['rest'])} {f(r.get('moe_floor_us'))} {f(r.get('moe_over_floor'), 6, 2)} "
              f"{f(r.get('moe_serial_floor_us'))} {f(r.get('moe_over_serial_floor'), 6, 2)} "
              f"{f(r['host_us_per_layer']['moe'], 6)} {f(p.get('moe'))} {f(k.get('busy_us'), 9)} {f(r['tokens_per_s_full_depth'], 11, 0)}")
    for r in shape_rec["results"]:
        k = r.get("kernels")
        if not k:
            continue
        print(f"  B {r['batch']} q {r['q_len']} graphed step: busy {k['busy_us']:.0f} us (graph / busy "
              f"{r['graph_us'] / k['busy_us']:.3f}); by kind " +
              ", ".join(f"{n} {v:.0f}" for n, v in sorted(k["by_kind_us"].items(), key=lambda i: -i[1])))
        print("    largest (exclusive us / calls): " +
              "; ".join(f"{e['name'][:70]} {e['exclusive_us']:.0f}/{e['calls']:g}" for e in k["kernels"][:12]))


LAYER_GROUPS = [("dense layers", "#8d6e63"), ("MoE layers", "#ef6c00"), ("embed, head, sampling", "#9e9e9e")]
KIND_COLOURS = {"attention": "#42a5f5", "rope+append": "#90caf9", "norm": "#ab47bc", "dispatch+combine": "#26a69a",
                "gemm": "#e53935", "quant": "#fdd835", "router": "#6d4c41", "embed+sampling": "#bdbdbd",
                "other": "#eeeeee"}


def write_svg(path, rec):
    """Per shape, batch and q_len: the full-depth step as measured (dense,
    MoE and the rest), as moelink-plan predicts it, the MoE layers' floor,
    and the graphed step's kernels by kind where profiled."""
    rows = []
    for s in rec["shapes"]:
        for r in s["results"]:
            lu, n = r["layer_us"], r["full_depth"]
            K = s["fields"]["first_k_dense_replace"]
            bars = [("measured", {"dense layers": K * lu["dense"], "MoE layers": (n - K) * lu["moe"],
                                  "embed, head, sampling": max(0.0, lu["rest"])})]
            p = r.get("plan_us")
            if p and p.get("dense") is not None:
                bars.append(("moelink-plan", {"dense layers": K * p["dense"], "MoE layers": (n - K) * p["moe"],
                                              "embed, head, sampling": p["head"]}))
            if "moe_floor_us" in r:
                bars.append(("MoE floor", {"MoE layers": (n - K) * r["moe_floor_us"]}))
            k = r.get("kernels")
            if k:
                bars.append(("kernels (graph)", {kind: us for kind, us in k["by_kind_us"].items()}))
            rows.append((f'{s["shape"]} B {r["batch"]} q {r["q_len"]}', bars))
    groups = LAYER_GROUPS + list(KIND_COLOURS.items())
    title = f'DeepSeek-V3 decode step on one {rec["gpu"]}: {rec["shapes"][0]["results"][0]["full_depth"]} layers'
    subtitle = (f'extrapolated from models of {rec["shapes"][0]["models_layers"]} layers; kv {rec["kv"]}; '
                f'kernels: the measured model\'s; {rec["date"][:10]}, commit {rec["git_commit"]}')
    from benchlib import stacked_bars_svg
    stacked_bars_svg(path, title, subtitle, rows, groups)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="ep8,world1", help="ep8, world1 (comma-separated)")
    p.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the dense ones (>= 1)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128", help="requests per step")
    p.add_argument("--q-lens", default="1,2", help="query rows per request: 1, or 2 (a draft verified)")
    p.add_argument("--kv", type=int, default=5000, help="context tokens of every request before the step")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--same-token", action="store_true",
                   help="every row the same token id (a random-weight model's greedy output in serving "
                        "repeats: every token then picks the same experts)")
    p.add_argument("--kv-spread", type=int, default=0,
                   help="contexts from kv to kv + this many tokens across a step's requests (a server's batch)")
    p.add_argument("--shuffle-pages", action="store_true",
                   help="the requests' pages in a random order of the pool (as a server's cache hands them out)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="the model's max_tokens (0: the largest batch times the largest q_len; "
                        "moelink-serve's is its --token-budget, 4096 in gpu_check.sh's serve runs)")
    p.add_argument("--acceptance", type=float, default=0.8, help="accepted drafts assumed in tokens_per_s")
    p.add_argument("--overlap", default="auto", help="the MoE layers' overlap mode")
    p.add_argument("--head-gemm", default="bf16", choices=("fp8", "bf16"), help="the attention's W_UK / W_UV GEMMs: bf16 or fp8")
    p.add_argument("--decode-kernel", default="auto", choices=("auto", "flashinfer", "flashmla", "moelink"),
                   help="the attention's decode kernel (ModelOptions / MLAOptions.decode_kernel)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile-batches", default="1,32,128", help="batches whose graphed step is profiled")
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--backend", default="nvlink")
    p.add_argument("--tiny", action="store_true", help="the tiny model's widths (a check of the benchmark)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where the random checkpoints are written and reused (default: /dev/shm/moelink-model-bench "
                        "where /dev/shm exists, else the temporary directory)")
    p.add_argument("--plan", help="the moelink-plan binary (adds its prediction)")
    p.add_argument("--plan-gpu", default=None,
                   help="moelink-plan's GPU profile (h100, h200, h800; default: the one the GPU's name names)")
    p.add_argument("--plan-calibrate", action="append", default=[],
                   help="moelink-plan --calibrate's file (moelink-bench or layer_bench.py JSON; repeatable)")
    p.add_argument("--machine", default=os.environ.get("MOELINK_MACHINE", "nvidia-h200"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="-", help="output file ('-': standard output)")
    p.add_argument("--svg", help="also draw the steps here (stacked bars)")
    a = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    a.batches, a.q_lens, a.profile_batches = ints(a.batches), ints(a.q_lens), ints(a.profile_batches)
    for q in a.q_lens:
        if q not in (1, 2):
            raise SystemExit(f"model_bench: --q-lens: {q} is not 1 or 2")
    if a.plan and not os.access(a.plan, os.X_OK):
        raise SystemExit(f"model_bench: --plan {a.plan}: no such executable (build the moelink-plan target)")
    if a.plan_gpu is not None and a.plan_gpu not in PLAN_GPUS.values():
        raise SystemExit(f"model_bench: --plan-gpu {a.plan_gpu!r}: one of {', '.join(sorted(PLAN_GPUS.values()))}")
    for f in a.plan_calibrate:
        if not os.path.isfile(f):
            raise SystemExit(f"model_bench: --plan-calibrate {f}: no such file")
    if a.kv < 0 or a.kv_spread < 0:
        raise SystemExit(f"model_bench: --kv {a.kv} and --kv-spread {a.kv_spread} must be >= 0")
    if a.moe_layers < 1 or not a.batches or min(a.batches) < 1:
        raise SystemExit("model_bench: --moe-layers and every batch must be >= 1")
    if a.max_tokens and not max(a.batches) * max(a.q_lens) <= a.max_tokens <= 65536:
        raise SystemExit(f"model_bench: --max-tokens {a.max_tokens} must be from the largest batch times the "
                         f"largest q_len ({max(a.batches) * max(a.q_lens)}) to 65536 (0: that product)")
    a.max_tokens = a.max_tokens or max(a.batches) * max(a.q_lens)
    if a.checkpoint_dir is None:
        import tempfile
        a.checkpoint_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                                        "moelink-model-bench")
    gpu = a.backend not in HOST_BACKENDS
    timer = Timer(gpu)
    rec = header("model_bench", a.machine, gpu=gpu)
    if a.plan and a.plan_gpu is None:
        a.plan_gpu = plan_gpu_of(rec["gpu"])
        if a.plan_gpu is None:
            a.plan_gpu = "h200"
            print(f"model_bench: no moelink-plan profile names {rec['gpu']!r}: --plan-gpu h200", file=sys.stderr)
    rec.update(backend=a.backend, kv=a.kv, page_size=a.page_size, acceptance=a.acceptance, overlap=a.overlap,
               head_gemm=a.head_gemm, decode_kernel=a.decode_kernel,
               same_token=a.same_token, kv_spread=a.kv_spread, shuffle_pages=a.shuffle_pages,
               max_tokens=a.max_tokens,
               moe_layers=a.moe_layers, tiny=a.tiny, plan_gpu=a.plan_gpu if a.plan else None,
               plan_calibrate=a.plan_calibrate)
    if gpu:
        from benchlib import bf16_tflops, copy_gbs
        from experts_bench import dense_fp8_tflops
        rec["copy_gbs"] = copy_gbs(10)
        rec["dense_fp8_tflops"] = dense_fp8_tflops(10)
        rec["bf16_tflops"] = bf16_tflops(10)
        print(f"model_bench: copy {rec['copy_gbs']:.0f} GB/s, dense fp8 {rec['dense_fp8_tflops']:.0f} TFLOP/s, "
              f"bf16 {rec['bf16_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)
    rec["shapes"] = []
    for shape in [s for s in a.shapes.split(",") if s]:
        rec["shapes"].append(run_shape(a, timer, shape, rec))
        print_table(rec["shapes"][-1])
        if a.json != "-":  # a run cut short keeps the shapes it finished
            write_json(rec, a.json)
    if a.json == "-":
        write_json(rec, a.json)
    if a.svg:
        write_svg(a.svg, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
