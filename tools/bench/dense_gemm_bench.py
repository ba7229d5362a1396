#!/usr/bin/env python3
"""moelink's dense fp8 block-scaled GEMM (Experts.gemm: the projections and
the shared expert) beside cuBLASLt's DeepSeek-recipe GEMM on the same data
(torch._scaled_mm with 1x128 activation scales and 128x128 weight scales,
CUDA 12.9+), on DeepSeek-V3's dense shapes at M tokens, with the ceilings
measured in the same run (copy bandwidth; dense fp8 peak).

Every output is checked against an fp32 product of the dequantized operands
before it is timed (relative L2 below 1e-2). Timing: each call captured
five times over in a CUDA graph whose replays are timed (experts_bench's
graph_us), so host work is left out. cuBLASLt's column is empty where torch
refuses the shape (one token: its 1x128 scales need M > 1).

--stream-k runs moelink once per MOELINK_EXPERTS_STREAM_K setting (auto,
off, streamk, or a split count; docs/experts.md), each on its own Experts
object, interleaved per shape and M: `moelink_us` is the first setting's,
`moelink_us_by_setting` has them all.

    PYTHONPATH=build/python:tools/bench python3 tools/bench/dense_gemm_bench.py --json out.json
"""
import argparse
import os
import sys

import torch

import moelink
from benchlib import copy_gbs, header, write_json
from experts_bench import block_weight, dense_fp8_tflops, dequant, graph_us, quant_rows

# name: (N, K), y [M, N] = x [M, K] . w[N, K]^T
SHAPES = {"qkv_a": (2176, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384),
          "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048),
          "dense_gate_up": (36864, 7168), "dense_down": (7168, 18432)}


def cublaslt_gemm(x, xs, w, ws):
    """torch._scaled_mm's block-scaled fp8 GEMM: x's 1x128 scales M-major
    (its layout rule), w's 128x128 scales as [K/128, N/128]."""
    return torch._scaled_mm(x, w.t(), xs.t().contiguous().t(), ws.t(), out_dtype=torch.bfloat16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    ap.add_argument("--m", default="1,8,32,64,128,256,512", help="token counts")
    ap.add_argument("--stream-k", default="auto",
                    help="MOELINK_EXPERTS_STREAM_K settings to time moelink under (comma-separated; the first is moelink_us)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--machine", default="nvidia-h200")
    ap.add_argument("--json", default="-")
    args = ap.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    for s in names:
        if s not in SHAPES:
            raise SystemExit(f"dense_gemm_bench: --shapes: unknown shape '{s}' (known: {', '.join(SHAPES)})")
    ms = [int(m) for m in args.m.split(",") if m]
    if not ms or min(ms) < 1:
        raise SystemExit(f"dense_gemm_bench: --m: token counts must be >= 1, got '{args.m}'")
    rec = header("dense_gemm_bench", args.machine)
    bw = copy_gbs(10) * 1e9
    peak = dense_fp8_tflops(args.iters) * 1e12
    rec.update(copy_gbs=bw / 1e9, dense_fp8_tflops=peak / 1e12, results=[])
    settings = [v for v in args.stream_k.split(",") if v]
    if not settings:
        raise SystemExit("dense_gemm_bench: --stream-k: give at least one setting")
    experts, prior = {}, os.environ.get("MOELINK_EXPERTS_STREAM_K")
    for v in settings:  # the setting is read when an Experts is created
        os.environ["MOELINK_EXPERTS_STREAM_K"] = v
        experts[v] = moelink.Experts(1, max(ms), 128, 128, expected_rows=16)
    if prior is None:
        os.environ.pop("MOELINK_EXPERTS_STREAM_K")
    else:
        os.environ["MOELINK_EXPERTS_STREAM_K"] = prior
    rec["stream_k_settings"] = settings
    for name in names:
        N, K = SHAPES[name]
        w, ws = block_weight(1, N, K)
        w, ws = w[0], ws[0]
        for m in ms:
            x, xs = quant_rows(torch.randn(m, K, device="cuda"))
            y = torch.empty(m, N, dtype=torch.bfloat16, device="cuda")
            ref = dequant(x, xs, 1) @ dequant(w, ws, 128).t()
            rel = lambda out: ((out.float() - ref).norm() / ref.norm()).item()
            ours = {v: (lambda ex=ex: ex.gemm(y, x, xs, w, ws)) for v, ex in experts.items()}
            err = {}
            for v, run in ours.items():
                y.fill_(float("nan"))  # every row must be written
                run()
                experts[v].check()
                err["moelink" if v == settings[0] else f"moelink[{v}]"] = rel(y)
            theirs = lambda: cublaslt_gemm(x, xs, w, ws)
            try:
                err["cublaslt"] = rel(theirs())
            except RuntimeError as e:  # torch refuses the layout (M = 1)
                theirs, err["cublaslt"] = None, None
                print(f"{name} M {m}: cuBLASLt refused: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            for k, e in err.items():
                if e is not None and not e < 1e-2:
                    raise SystemExit(f"dense_gemm_bench: {name} M={m}: {k} relative L2 {e:.2e} against fp32")
            by_setting = {v: graph_us(run, args.iters, reps=5) for v, run in ours.items()}
            t_ours = by_setting[settings[0]]
            t_theirs = graph_us(theirs, args.iters, reps=5) if theirs else None
            weight_bytes = w.numel() + ws.numel() * 4
            floor = max((weight_bytes + x.numel() + 2 * m * N) / bw * 1e6, 2 * m * N * K / peak * 1e6)
            rec["results"].append({"shape": name, "m": m, "n": N, "k": K, "moelink_us": t_ours,
                                   "moelink_us_by_setting": by_setting, "cublaslt_us": t_theirs,
                                   "floor_us": floor, "rel_l2_vs_fp32": err})
            others = "".join(f", [{v}] {t:6.1f}" for v, t in by_setting.items() if v != settings[0])
            print(f"{name:15s} M {m:4d}: moelink {t_ours:7.1f} us{others}, cuBLASLt "
                  f"{'-' if t_theirs is None else f'{t_theirs:7.1f}'} us, floor {floor:6.1f} us", flush=True)
    write_json(rec, args.json)


if __name__ == "__main__":
    main()
