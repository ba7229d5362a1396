#!/usr/bin/env python3
"""moelink-layer-bench: the MoE layer (moelink.MoELayer) on this machine's
GPUs, stage by stage.

For each batch (tokens per rank), overlap mode and eager / CUDA-graph run:
the layer's wall time (CUDA events around forward(), medians), and from a
profiled eager forward the time of each stage (quantize, router, dispatch
send / receive, shared expert, GEMM1, SiLU-mul, GEMM2, combine send /
receive) and their sum; the HBM floor (the bytes the layer must read: the
router, the shared expert and every expert some token goes to, plus tokens
in and out, at the copy bandwidth this process measures). Random
DeepSeek-V3-shaped weights in fp8 with 128 x 128 scales, top-8 routing from
the real router.

    PYTHONPATH=build-gpu/python python3 tools/bench/layer_bench.py --json out.json

One process, world 1 (every expert local; the NVLink backend's dispatch
and combine still run). Not run yet on the H200 (docs/moe_layer.md).
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys

import torch

import moelink


def _boot():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return moelink.TcpBootstrap(0, 1, "127.0.0.1", port, 30.0)


def block_fp8(shape, std):
    """Random fp8 weights [..., n, k] with one fp32 scale per 128 x 128 block."""
    w = torch.randn(*shape, device="cuda") * std
    n, k = shape[-2:]
    s = w.unflatten(-2, (n // 128, 128)).unflatten(-1, (k // 128, 128)).abs().amax(dim=(-3, -1)) / 448
    q = (w / s.repeat_interleave(128, -2).repeat_interleave(128, -1)).to(torch.float8_e4m3fn)
    return q, s.float().contiguous()


def copy_gbs():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * n * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,4096")
    p.add_argument("--modes", default="none,dispatch-overlap,micro-batch")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--machine", default="nvidia-h200")
    p.add_argument("--json", default="-")
    a = p.parse_args()
    cfg = moelink.model_config(a.model)
    E, H, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    Is = cfg.n_shared_experts * I
    torch.manual_seed(0)
    w13, w13s = block_fp8((E, 2 * I, H), 0.02)
    w2, w2s = block_fp8((E, H, I), 0.02)
    sw13, sw13s = block_fp8((2 * Is, H), 0.02)
    sw2, sw2s = block_fp8((H, Is), 0.02)
    gate = (torch.randn(E, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.05
    bw = copy_gbs()
    rec = {"tool": "tools/bench/layer_bench.py", "machine": a.machine,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "git_commit": os.environ.get("MOELINK_GIT_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "model": repr(cfg), "copy_gbs": bw, "results": []}
    expert_bytes = 3 * I * H + 3 * (I // 128) * (H // 128) * 4
    for batch in [int(b) for b in a.batches.split(",")]:
        x = torch.randn(batch, H, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(x)
        bm = torch.tensor([batch], dtype=torch.int32, device="cuda")
        touched = E * (1 - (1 - k / E) ** batch)  # experts some token goes to, expected
        floor_bytes = (E * H * 2 + touched * expert_bytes + 3 * Is * H + batch * H * 4)
        for mode in a.modes.split(","):
            for graphs in (False, True):
                layer = moelink.MoELayer(cfg, max_tokens=batch, backend="nvlink", bootstrap=_boot(),
                                         overlap=mode, cuda_graphs=graphs, profile=not graphs)
                layer.set_weights(gate, w13, w2, gate_bias=bias, w13_scale=w13s, w2_scale=w2s,
                                  shared_w13=sw13, shared_w13_scale=sw13s, shared_w2=sw2,
                                  shared_w2_scale=sw2s)
                for _ in range(3):
                    layer.forward(out, x, bm, num_tokens=batch)
                torch.cuda.synchronize()
                layer.check()
                stages = layer.stage_times() if not graphs else {}
                times = []
                for _ in range(a.iters):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    layer.forward(out, x, bm, num_tokens=batch)
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
                wall = statistics.median(times)
                r = {"batch": batch, "mode": mode, "graphs": graphs, "wall_us": wall,
                     "floor_us": floor_bytes / (bw * 1e9) * 1e6, "stages_us": stages}
                if stages:
                    r["sum_of_stages_us"] = sum(v for kk, v in stages.items() if kk != "total_us")
                r["wall_over_floor"] = wall / r["floor_us"]
                rec["results"].append(r)
                print(f"batch {batch:5d} {mode:16s} {'graph' if graphs else 'eager':5s} "
                      f"wall {wall:9.1f} us  floor {r['floor_us']:8.1f} us  "
                      f"wall/floor {r['wall_over_floor']:5.2f}", file=sys.stderr)
                del layer
                torch.cuda.empty_cache()
    out_text = json.dumps(rec, indent=1)
    if a.json == "-":
        print(out_text)
    else:
        with open(a.json, "w") as f:
            f.write(out_text + "\n")


if __name__ == "__main__":
    main()
