#!/usr/bin/env python3
"""moelink-layer-bench: the MoE layer (moelink.MoELayer) on this machine's
GPU, stage by stage.

For each batch (tokens per rank), overlap mode and eager / CUDA-graph run:
  wall_us            the layer's wall time: CUDA events around forward(),
                     median of --iters calls (a layer built without profile);
  stages_us          GPU time per stage (quantize, router, dispatch send /
                     receive, shared expert, GEMM1, SiLU-mul, GEMM2, combine
                     send / receive; "other_us" a graph's row staging): the
                     kernels torch.profiler saw, assigned to stages by
                     layer_report.stage_of_kernels, each for its exclusive
                     time (benchlib.exclusive_us: a kernel launched early
                     under programmatic dependent launch waits for the one
                     before; that wait is not its stage's), so the stages
                     add up to busy_us (not for micro-batch, whose stages
                     interleave);
  stage_marks_us     eager only: the time between the layer's own stage marks
                     (a layer built with profile=True), median over --iters
                     forwards; it includes the host's launch gaps;
  sum_of_kernels_us  what the GPU spent in kernels and copies per forward,
                     from torch.profiler (CUPTI sees every kernel of the
                     process, inside CUDA graphs too): the "no gaps" bound
                     the wall time is held to; busy_us the union of their
                     intervals; kernels[] the same by kernel name (us:
                     their spans, exclusive_us: their share of busy_us);
  floor_us           the HBM floor: every byte the layer must move (the
                     router's weight, the shared expert, every expert some
                     token of this routing goes to, the scales, x in and out)
                     at the device-copy bandwidth this process measures.
Random DeepSeek-V3-shaped weights, fp8 with 128 x 128 scales; the real
router on random tokens picks the experts.

    PYTHONPATH=build-gpu/python python3 tools/bench/layer_bench.py --json out.json
    python3 tools/bench/layer_report.py out.json --plan build-plan/tools/plan/moelink-plan --svg out.svg

World 1 (default): one process, every expert local (the NVLink backend's
dispatch and combine kernels still run, as local copies). --world N starts N
processes, rank r on GPU r % (GPUs here), each holding E / N experts and its
own batch of tokens (the batch is per rank); a cell's wall_us,
sum_of_kernels_us and floor_us are the slowest rank's (the step waits for
all), each rank's in *_by_rank, stages_us rank 0's. The floor at world > 1
is HBM only (each rank's touched local experts); the NVLink transfer is on
top. Ranks sharing a GPU check the script, not the layer's speed.

    python3 tools/bench/layer_bench.py --world 2 --batches 8,32,64,128 --json w2.json

--experts N (e.g. 32 of DeepSeek-V3's 256): the layer with N routed experts
on one process, every token routed among them: a stand-in for one rank of
EP E / N, whose experts each receive what an EP rank's expert receives on
average (the router and the exchange are not the rank's: moelink-plan
--calibrate takes such a file for that rank's experts and shared expert).
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

import moelink
from benchlib import copy_gbs, exclusive_us, free_port, gpu_spans, median_event_us, span_profile
from layer_report import STAGES, stage_of_kernels


def block_fp8(shape, std):
    """Random fp8 weights [..., n, k] with one fp32 scale per 128 x 128 block,
    made 8 matrices at a time (DeepSeek-V3's 256 experts in fp32 at once
    would take 30 GB)."""
    *lead, n, k = shape
    count = math.prod(lead)
    qs, ss = [], []
    for i in range(0, count, 8):
        w = torch.randn(min(8, count - i), n, k, device="cuda") * std
        s = w.unflatten(-2, (n // 128, 128)).unflatten(-1, (k // 128, 128)).abs().amax(dim=(-3, -1)) / 448
        qs.append((w / s.repeat_interleave(128, -2).repeat_interleave(128, -1)).to(torch.float8_e4m3fn))
        ss.append(s.float())
    return (torch.cat(qs).reshape(shape).contiguous(),
            torch.cat(ss).reshape(*lead, n // 128, k // 128).contiguous())


def kernel_profile(fn, iters, by_stage):
    """GPU work per call of fn() (benchlib.span_profile) and, with by_stage,
    by layer stage (stage_of_kernels), each kernel counted for its exclusive
    time (benchlib.exclusive_us: the layer's kernels run under programmatic
    dependent launch, and a kernel's span includes its wait for the one
    before)."""
    spans = gpu_spans(fn, iters)
    if not spans:
        return None
    excl = exclusive_us(spans)
    out = span_profile(spans, iters, excl)
    if by_stage:
        stages = dict.fromkeys(STAGES + ("other_us",), 0.0)
        for x, st in zip(excl, stage_of_kernels([n for _, _, n in spans])):
            stages[st] += x / iters
        out["stages_us"] = stages
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--experts", type=int, default=0,
                   help="routed experts of the layer (default: the model's); E / EP of them on one process "
                        "stand in for one rank of EP (each receives what an EP rank's expert does on average; "
                        "moelink-plan --calibrate takes such a file for that rank's experts)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,4096")
    p.add_argument("--modes", default="none,dispatch-overlap,micro-batch")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per cell (medians)")
    p.add_argument("--profile-iters", type=int, default=5, help="forwards under torch.profiler")
    p.add_argument("--machine", default="nvidia-h200")
    p.add_argument("--json", default="-")
    p.add_argument("--world", type=int, default=1,
                   help="ranks (processes), rank r on GPU r %% GPUs; the batch is per rank")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a spawned rank
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.world < 1:
        p.error(f"--world = {a.world} must be at least 1")
    if a.world > 1 and a.rank is None:
        return run_ranks(a)
    rank = a.rank or 0
    torch.cuda.set_device(rank % torch.cuda.device_count())
    boot = moelink.TcpBootstrap(rank, a.world, "127.0.0.1", a.port or free_port(), 60.0)
    cfg = moelink.model_config(a.model)
    model_experts = cfg.n_routed_experts
    if a.experts:
        if not cfg.num_experts_per_tok <= a.experts <= model_experts:
            p.error(f"--experts = {a.experts} must be in [{cfg.num_experts_per_tok} (top-k), "
                    f"{model_experts} (the model's)]")
        cfg.n_routed_experts = a.experts
    E, H, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    if E % a.world:
        p.error(f"--world = {a.world} must divide the model's {E} routed experts")
    L = E // a.world
    Is = cfg.n_shared_experts * I
    torch.manual_seed(0)  # the router and the shared expert: the same on every rank
    gate = (torch.randn(E, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.05
    shared = {}
    if Is:
        sw13, sw13s = block_fp8((2 * Is, H), 0.02)
        sw2, sw2s = block_fp8((H, Is), 0.02)
        shared = dict(shared_w13=sw13, shared_w13_scale=sw13s, shared_w2=sw2, shared_w2_scale=sw2s)
    torch.manual_seed(1 + rank)  # this rank's experts
    w13, w13s = block_fp8((L, 2 * I, H), 0.02)
    w2, w2s = block_fp8((L, H, I), 0.02)
    bw = copy_gbs(10)
    rec = {"tool": "tools/bench/layer_bench.py", "machine": a.machine,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(["layer_bench.py"] + sys.argv[1:]),
           "git_commit": os.environ.get("MOELINK_GIT_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "world_size": a.world,
           "model": {"name": cfg.name, "preset": a.model, "hidden_size": H, "moe_intermediate_size": I,
                     "n_routed_experts": E, "num_experts_per_tok": k,
                     "n_shared_experts": cfg.n_shared_experts, "model_n_routed_experts": model_experts},
           "copy_gbs": bw, "results": []}
    expert_bytes = 3 * I * H + 3 * (I // 128) * (H // 128) * 4  # fp8 w13 + w2 and their scales
    shared_bytes = 3 * Is * H + 3 * (Is // 128) * (H // 128) * 4
    batches = [int(b) for b in a.batches.split(",")]

    def new_layer(batch, mode, graphs, profile):
        layer = moelink.MoELayer(cfg, max_tokens=batch, backend="nvlink", bootstrap=boot,
                                 overlap=mode, cuda_graphs=graphs, profile=profile)
        layer.set_weights(gate, w13, w2, gate_bias=bias, w13_scale=w13s, w2_scale=w2s, **shared)
        return layer

    for batch in batches:
        # Every rank's tokens (rank r's from seed 100 + r), routed here: the
        # local experts some token of any rank goes to (the floor reads only
        # those).
        xs = []
        for r in range(a.world):
            torch.manual_seed(100 + r)
            xs.append(torch.randn(batch, H, device="cuda").to(torch.bfloat16))
        x = xs[rank]
        out = torch.empty_like(x)
        bm = torch.tensor([batch], dtype=torch.int32, device="cuda")
        probe = new_layer(batch, "none", False, False)
        idx = torch.empty(batch, k, dtype=torch.int32, device="cuda")
        wts = torch.empty(batch, k, dtype=torch.float32, device="cuda")
        mine = set()
        for xr in xs:
            probe.route(idx, wts, xr, bm)
            mine |= {e for e in torch.unique(idx).tolist() if rank * L <= e < (rank + 1) * L}
        touched = len(mine)
        del probe, xs
        floor_bytes = E * H * 2 + touched * expert_bytes + shared_bytes + batch * H * 4
        floor_us = floor_bytes / (bw * 1e9) * 1e6
        for mode in a.modes.split(","):
            if mode == "micro-batch" and batch < 2:
                continue  # two micro-batches need two tokens
            for graphs in (False, True):
                layer = new_layer(batch, mode, graphs, False)

                def fwd():
                    layer.forward(out, x, bm, num_tokens=batch)

                for _ in range(3):
                    fwd()
                torch.cuda.synchronize()
                layer.check()
                wall = median_event_us(fwd, a.iters, warmup=0, sync_each=True)
                r = {"batch": batch, "mode": mode, "graphs": graphs, "touched_experts": touched,
                     "wall_us": wall, "floor_bytes": floor_bytes, "floor_us": floor_us,
                     "wall_over_floor": wall / floor_us}
                kp = kernel_profile(fwd, a.profile_iters, by_stage=mode != "micro-batch")
                if kp:
                    r.update(kp)
                    r["wall_over_kernels"] = wall / kp["sum_of_kernels_us"]
                del layer
                if not graphs:
                    # Stage marks come from a layer built with profile=True.
                    layer = new_layer(batch, mode, False, True)
                    samples = []
                    for i in range(a.iters + 2):
                        layer.forward(out, x, bm, num_tokens=batch)
                        if i >= 2:
                            samples.append(layer.stage_times())
                    layer.check()
                    keys = ("total_us",) if mode == "micro-batch" else STAGES + ("total_us",)
                    r["stage_marks_us"] = {s: statistics.median(t[s] for t in samples) for s in keys}
                    del layer
                rec["results"].append(r)
                if not rank:
                    print(f"batch {batch:5d} {mode:16s} {'graph' if graphs else 'eager':5s} "
                          f"wall {wall:9.1f} us  kernels {r.get('sum_of_kernels_us', float('nan')):9.1f} us  "
                          f"floor {floor_us:8.1f} us  wall/floor {r['wall_over_floor']:5.2f}"
                          + (" (rank 0)" if a.world > 1 else ""), file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
                if a.json != "-":  # after every cell: a run cut short keeps what it measured
                    with open(a.json, "w") as f:
                        f.write(json.dumps(rec, indent=1) + "\n")
    if a.json == "-":
        print(json.dumps(rec, indent=1))


def run_ranks(a):
    """--world N: this script once per rank (same arguments, --rank r, one
    bootstrap port), each writing its own JSON; then one record whose cells
    hold the slowest rank's times and every rank's in *_by_rank."""
    import tempfile
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="layer_bench.") as tmp:
        argv = [x for x in sys.argv[1:]]
        if "--json" in argv:
            i = argv.index("--json")
            del argv[i:i + 2]
        argv = [x for x in argv if not x.startswith("--json=")]
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--rank", str(r),
                                   "--port", str(port), "--json", os.path.join(tmp, f"rank{r}.json")])
                 for r in range(a.world)]
        # A rank that fails leaves the others in a collective: they get 30 s
        # to finish, then are stopped (never a hang).
        failed_at = None
        while any(pr.poll() is None for pr in procs):
            if failed_at is None and any(pr.poll() not in (None, 0) for pr in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + 30:
                for pr in procs:
                    if pr.poll() is None:
                        pr.kill()
            time.sleep(0.2)
        codes = [pr.wait() for pr in procs]
        recs = []
        for r in range(a.world):
            try:
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    recs.append(json.load(f))
            except (OSError, ValueError):
                recs.append({"results": []})
    rec = dict(recs[0])
    rec["command"] = " ".join(["layer_bench.py"] + sys.argv[1:])
    rec["rank_exit_codes"] = codes
    cells = min(len(x["results"]) for x in recs)  # a rank that failed early cuts the run
    rec["results"] = []
    for i in range(cells):
        rs = [x["results"][i] for x in recs]
        c = dict(rs[0])
        for key in ("wall_us", "sum_of_kernels_us", "floor_us", "floor_bytes", "touched_experts"):
            if all(key in x for x in rs):
                c[key + "_by_rank"] = [x[key] for x in rs]
                c[key] = max(x[key] for x in rs)
        c["wall_over_floor"] = c["wall_us"] / c["floor_us"]
        if "sum_of_kernels_us" in c:
            c["wall_over_kernels"] = c["wall_us"] / c["sum_of_kernels_us"]
        rec["results"].append(c)
    text = json.dumps(rec, indent=1) + "\n"
    if a.json == "-":
        print(text, end="")
    else:
        with open(a.json, "w") as f:
            f.write(text)
    if any(codes):
        sys.exit(f"layer_bench: rank exit codes {codes}; kept the {cells} cells every rank finished")


if __name__ == "__main__":
    main()
