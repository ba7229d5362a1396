#!/usr/bin/env python3
"""Measures, on this machine's GPU, the memory efficiency of the MoE expert
GEMMs that moelink-plan models with a roofline: DeepSeek-V3's routed experts
in fp8 (gate/up 7168 -> 2 x 2048, down 2048 -> 7168), L local experts, m
tokens per expert, one grouped GEMM per projection (torch._scaled_grouped_mm,
fp8 with row-wise scales). Prints a JSON record: per m, the time of both
projections and the fraction of the HBM bandwidth the weights and
activations moved at, next to a plain device-to-device copy measured in the
same run (the bandwidth a kernel can reach here).

    python3 tools/plan/measure_grouped_gemm.py --experts 32 --json out.json
"""
import argparse
import datetime
import json
import subprocess
import sys

import torch


def timed(fn, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # us


def copy_bandwidth(iters):
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), iters)
    return 2 * n / (us * 1e-6)  # read + write bytes per second


def grouped(experts, m, n_out, k_in, iters):
    """One fp8 grouped GEMM: experts groups of [m, k_in] x [k_in, n_out]."""
    fp8 = torch.float8_e4m3fn
    # Rows per group padded to 16 (the kernel's alignment rule), as a serving
    # engine pads its batched-experts layout.
    rows = (m + 15) // 16 * 16
    a = torch.randn(experts * rows, k_in, device="cuda").to(fp8)
    w = torch.randn(experts, n_out, k_in, device="cuda").to(fp8)  # [G, N, K], K contiguous
    b = w.transpose(-2, -1)                                        # [G, K, N], column-major
    scale_a = torch.ones(experts * rows, device="cuda", dtype=torch.float32)
    scale_b = torch.ones(experts, n_out, device="cuda", dtype=torch.float32)
    offs = torch.arange(rows, experts * rows + 1, rows, device="cuda", dtype=torch.int32)
    fn = lambda: torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs,
                                          out_dtype=torch.bfloat16, use_fast_accum=True)
    us = timed(fn, iters)
    # Bytes a roofline counts: weights once, fp8 activations in, bf16 out
    # (the m real rows, not the padding).
    moved = experts * (n_out * k_in + m * k_in + 2 * m * n_out)
    return us, moved


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32, help="local experts (EP8: 256 / 8)")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128", help="tokens per expert")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--hbm-gbs", type=float, default=4800, help="nominal HBM bandwidth, GB/s")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default="-")
    a = p.parse_args()
    torch.manual_seed(0)
    rec = {
        "tool": "measure_grouped_gemm.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "kernel": "torch._scaled_grouped_mm, fp8 e4m3, row-wise scales, bf16 out, fast accum",
        "nominal_hbm_gbs": a.hbm_gbs,
    }
    try:
        rec["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    except OSError:
        pass
    copy = copy_bandwidth(a.iters)
    rec["copy_gbs"] = copy / 1e9
    rec["copy_fraction_of_nominal"] = copy / (a.hbm_gbs * 1e9)
    rows = []
    for m in [int(t) for t in a.tokens.split(",")]:
        up_us, up_b = grouped(a.experts, m, 2 * a.intermediate, a.hidden, a.iters)
        down_us, down_b = grouped(a.experts, m, a.hidden, a.intermediate, a.iters)
        us, moved = up_us + down_us, up_b + down_b
        rows.append({"tokens_per_expert": m, "gate_up_us": up_us, "down_us": down_us,
                     "total_us": us, "bytes": moved,
                     "gbs": moved / (us * 1e-6) / 1e9,
                     "fraction_of_nominal": moved / (us * 1e-6) / (a.hbm_gbs * 1e9),
                     "fraction_of_copy": moved / (us * 1e-6) / copy})
        print(f"m={m:4d}  gate/up {up_us:7.1f} us  down {down_us:7.1f} us  "
              f"{rows[-1]['gbs']:7.0f} GB/s = {rows[-1]['fraction_of_nominal']:.3f} of "
              f"{a.hbm_gbs:.0f}", file=sys.stderr)
    rec["results"] = rows
    out = json.dumps(rec, indent=1)
    if a.json == "-":
        print(out)
    else:
        open(a.json, "w").write(out + "\n")


if __name__ == "__main__":
    main()
