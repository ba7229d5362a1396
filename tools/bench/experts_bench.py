#!/usr/bin/env python3
"""moelink-experts-bench: the expert kernels (moelink.Experts) on one GPU,
side by side in one process with torch._scaled_grouped_mm on the same data,
and the two ceilings the benchmark measures itself: a device-to-device copy
(HBM bandwidth, bytes read + written) and a large dense fp8 GEMM
(torch._scaled_mm, tensor-core peak).

DeepSeek-V3's routed experts (H 7168, I 2048) with L local experts (32: one
EP8 rank; 8: EP32) and m rows per expert (uniform counts). For each (L, m):
  ours      forward() = GEMM1 (gate/up) + SiLU-mul + requant + GEMM2 (down),
            and each kernel alone
  torch     _scaled_grouped_mm for GEMM1 and GEMM2 (fp8, row-wise scales: the
            finest it offers here), no SiLU: a lower bound on its layer time
  floor     the bytes a layer must move (both weights, x and its scales in,
            y out; intermediates left on chip) at the measured copy bandwidth
and the FLOP rate against the measured dense peak. Also the quantization
kernels' bandwidth, and with --dense the dense block-scaled GEMM
(Experts.gemm: a shared expert's GEMM1 and GEMM2 on M tokens) beside
torch._scaled_mm with row-wise scales on the same data. Every
configuration's output is checked against a dequantized fp32 torch matmul
before it is timed, and the run stops on one out of bounds, so a fast wrong
result cannot win. Timing: each call captured (10 times over) in a CUDA
graph whose replays are timed with CUDA events, so host overhead is left
out; rounds interleaved (ours, torch, ours, torch, ...); medians.

    PYTHONPATH=build/python python3 tools/bench/experts_bench.py --json out.json
"""
import argparse
import os
import statistics
import sys

import torch

import moelink
from benchlib import copy_gbs, header, median_event_us as median_us, write_json

FP8 = torch.float8_e4m3fn


def graph_us(fn, iters, reps=10):
    """Median GPU time of one fn() call: `reps` calls captured in one CUDA
    graph, its replays timed, so that no host work (Python, argument checks,
    launches) sits between the kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up (and lazy initialization) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    us = median_us(g.replay, iters, warmup=1) / reps
    del g
    return us


def dense_fp8_tflops(iters, n=8192):
    a = torch.randn(n, n, device="cuda").to(FP8)
    b = torch.randn(n, n, device="cuda").to(FP8).t()
    one = torch.ones((), device="cuda")
    us = graph_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), iters, reps=4)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def block_weight(L, n, k):
    """fp8 weights [L, n, k] with one fp32 scale per 128x128 block."""
    w = (torch.randn(L, n, k, device="cuda") * 0.05)
    blocks = w.view(L, n // 128, 128, k // 128, 128).abs().amax(dim=(2, 4))
    scale = (blocks / 448.0).float().contiguous()
    q = (w / scale.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(FP8)
    return q, scale


def quant_rows(x):
    """bf16/fp32 [..., K] -> fp8 + [..., K/128] scales (the 1x128 rule)."""
    g = x.float().unflatten(-1, (-1, 128))
    s = (g.abs().amax(-1).clamp_min(1e-10) / 448.0)
    q = (g / s.unsqueeze(-1)).clamp(-448, 448).to(FP8).flatten(-2)
    return q, s.contiguous()


def dequant(q, s, block_rows):
    """q [..., R, K] fp8 with scales [..., R/block_rows, K/128] -> fp32."""
    f = q.float()
    s = s.repeat_interleave(128, -1)
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, -2)
    return f * s


class Case:
    """One (L, m): our tensors and torch's views of the same data."""

    def __init__(self, L, m, H, I, experts, shared=None):
        self.L, self.m, self.H, self.I = L, m, H, I
        self.C = max(16, (m + 15) // 16 * 16)  # rows per expert: m padded to 16 (torch's rule)
        C = self.C
        if shared is None:
            self.w13, self.w13_s = block_weight(L, 2 * I, H)
            self.w2, self.w2_s = block_weight(L, H, I)
            self.x, self.x_s = quant_rows(torch.randn(L, C, H, device="cuda"))
        else:  # another tile configuration on the same weights and tokens
            self.w13, self.w13_s, self.w2, self.w2_s = shared.w13, shared.w13_s, shared.w2, shared.w2_s
            self.x, self.x_s = shared.x, shared.x_s
        self.count = torch.full((L,), m, dtype=torch.int32, device="cuda")
        self.y = torch.empty(L, C, H, dtype=torch.bfloat16, device="cuda")
        self.gu = torch.empty(L, C, 2 * I, dtype=torch.bfloat16, device="cuda")
        self.act = torch.empty(L, C, I, dtype=FP8, device="cuda")
        self.act_s = torch.empty(L, C, I // 128, dtype=torch.float32, device="cuda")
        self.ex = experts
        # torch: A [L*C, K] (the same bytes), B [L, K, N] column-major (the
        # same weight bytes transposed), row-wise scales, offsets every C rows.
        self.offs = torch.arange(C, L * C + 1, C, device="cuda", dtype=torch.int32)
        self.t_sa1 = torch.ones(L * C, device="cuda")
        self.t_sb1 = torch.ones(L, 2 * I, device="cuda")
        self.t_sa2 = torch.ones(L * C, device="cuda")
        self.t_sb2 = torch.ones(L, H, device="cuda")
        self.t_act = self.act.view(L * C, I)  # filled by our silu_mul_quant in check()

    # ---- ours
    def gemm1(self):
        self.ex.grouped_gemm(self.gu, self.count, self.x, self.x_s, self.w13, self.w13_s)

    def silu(self):
        self.ex.silu_mul_quant(self.act, self.act_s, self.gu, self.count)

    def gemm2(self):
        self.ex.grouped_gemm(self.y, self.count, self.act, self.act_s, self.w2, self.w2_s)

    def forward(self):
        self.ex.forward(self.y, self.count, self.x, self.x_s, self.w13, self.w13_s, self.w2,
                        self.w2_s)

    # ---- torch
    def torch_gemm1(self):
        return torch._scaled_grouped_mm(self.x.view(-1, self.H), self.w13.transpose(-2, -1),
                                        self.t_sa1, self.t_sb1, offs=self.offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    def torch_gemm2(self):
        return torch._scaled_grouped_mm(self.t_act, self.w2.transpose(-2, -1), self.t_sa2,
                                        self.t_sb2, offs=self.offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def torch_layer(self):
        self.torch_gemm1()
        self.torch_gemm2()

    # ---- sizes
    def floor_bytes(self):
        L, m, H, I = self.L, self.m, self.H, self.I
        weights = L * (2 * I * H + H * I) + L * (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4
        return weights + L * m * (H + H // 128 * 4) + L * m * H * 2

    def flops(self):
        return 2 * self.L * self.m * (2 * self.I * self.H + self.H * self.I)

    def check(self):
        """forward() against a dequantized fp32 torch computation, expert 0 and the last."""
        self.forward()
        torch.cuda.synchronize()
        self.ex.check()
        worst = 0.0
        for l in (0, self.L - 1):
            x = dequant(self.x[l, :self.m], self.x_s[l, :self.m], 1)
            gu = (x @ dequant(self.w13[l], self.w13_s[l], 128).t()).to(torch.bfloat16).float()
            v = torch.nn.functional.silu(gu[:, :self.I]) * gu[:, self.I:]
            q, s = quant_rows(v)
            ref = dequant(q, s, 1) @ dequant(self.w2[l], self.w2_s[l], 128).t()
            err = (self.y[l, :self.m].float() - ref).norm() / ref.norm()
            worst = max(worst, err.item())
        return worst


def apply_env(env):
    """Sets (value) or unsets (None) the variables an Experts reads when it is created."""
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def require_close(errs, bound, what):
    """Stops the run when a variant's relative L2 error is above `bound` (or NaN)."""
    bad = {name: e for name, e in errs.items() if not e < bound}
    if bad:
        sys.exit(f"experts_bench.py: {what}: relative L2 error above {bound} against the fp32 "
                 f"reference: {bad}")


def dense_results(a, variants, env_vars, peak):
    """Experts.gemm on [M, K] x [N, K]^T for a shared expert's two GEMMs
    (gate/up: N = 2I, K = H; down: N = H, K = I), each variant beside
    torch._scaled_mm (row-wise scales), interleaved rounds."""
    H, I = a.hidden, a.intermediate
    out = []
    for M in [int(v) for v in a.dense.split(",") if v]:
        for gemm, N, K in (("gemm1", 2 * I, H), ("gemm2", H, I)):
            w, ws = block_weight(1, N, K)
            x, xs = quant_rows(torch.randn(M, K, device="cuda"))
            fns, ys = {}, {}
            for name, env in variants:
                apply_env(env)
                ex = moelink.Experts(1, 128, H, I, expected_rows=16)
                ys[name] = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                fns[name] = lambda ex=ex, y=ys[name]: ex.gemm(y, x, xs, w[0], ws[0])
            apply_env(dict.fromkeys(env_vars))  # every variable back to unset
            sa = torch.ones(M, 1, device="cuda")
            sb = torch.ones(1, N, device="cuda")
            wt = w[0].t()
            fns["torch"] = lambda: torch._scaled_mm(x, wt, sa, sb, out_dtype=torch.bfloat16)
            rows = torch.cat([torch.arange(0, 64), torch.arange(M - 64, M)]).cuda()
            ref = dequant(x[rows], xs[rows], 1) @ dequant(w[0], ws[0], 128).t()
            errs = {}
            for name in ys:
                fns[name]()
                torch.cuda.synchronize()
                errs[name] = ((ys[name][rows].float() - ref).norm() / ref.norm()).item()
            require_close(errs, 1e-2, f"dense M={M} {gemm}")  # measured: 1.7e-3
            times = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, f in fns.items():
                    times[k].append(graph_us(f, a.iters, reps=3))
            flops = 2 * M * N * K
            r = {"M": M, "gemm": gemm, "N": N, "K": K, "flops": flops,
                 "torch_us": statistics.median(times["torch"]), "torch_us_rounds": times["torch"],
                 "ours": {}}
            for name in ys:
                us = statistics.median(times[name])
                r["ours"][name] = {"us": us, "us_rounds": times[name], "rel_l2_vs_fp32": errs[name],
                                   "tflops": flops / (us * 1e-6) / 1e12,
                                   "fraction_of_dense_peak": flops / (us * 1e-6) / 1e12 / peak,
                                   "torch_over_ours": r["torch_us"] / us}
                o = r["ours"][name]
                print(f"dense M={M:6d} {gemm} {name:18s} ours {us:8.1f} us  torch {r['torch_us']:8.1f}  "
                      f"torch/ours {o['torch_over_ours']:5.2f}  {o['tflops']:6.0f} TFLOP/s "
                      f"({o['fraction_of_dense_peak']:.2f} of peak)  err {errs[name]:.1e}", file=sys.stderr)
            out.append(r)
            del fns, ys
            torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", default="32,8", help="local experts L (32: EP8, 8: EP32)")
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512,1024,2048",
                   help="rows per expert m (empty: no grouped cases)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians taken over all)")
    p.add_argument("--tiles", default="", help="GEMM tile configurations to compare (names as "
                   "MOELINK_EXPERTS_TILES takes; needs a build with MOELINK_EXPERTS_TILE_SWEEP); "
                   "empty: the library's choice ('auto')")
    p.add_argument("--split-k", default="", help="split-over-K settings to compare (values "
                   "MOELINK_EXPERTS_SPLIT_K takes: auto, 1 to 8), each with every --tiles entry; "
                   "empty: the library's choice")
    p.add_argument("--env", action="append", default=[], metavar="VAR=V1,V2",
                   help="an environment variable an Experts reads (MOELINK_EXPERTS_PDL, "
                   "MOELINK_EXPERTS_GEMM_CTAS, ...) and the values to compare, each with every "
                   "other variant; repeatable")
    p.add_argument("--dense", default="", help="token counts M for the dense GEMM (Experts.gemm "
                   "on a shared expert's shapes beside torch._scaled_mm); empty: none")
    p.add_argument("--machine", default="nvidia-h200")
    p.add_argument("--json", default="-")
    a = p.parse_args()
    torch.manual_seed(0)
    H, I = a.hidden, a.intermediate
    rec = {
        **header("tools/bench/experts_bench.py", a.machine),
        "shape": {"hidden": H, "intermediate": I},
        "peer": "torch._scaled_grouped_mm (fp8 e4m3, row-wise scales, bf16 out, fast accum), "
                "GEMM1 + GEMM2 only",
    }
    rec["copy_gbs"] = copy_gbs(a.iters)
    rec["dense_fp8_tflops"] = dense_fp8_tflops(a.iters)
    print(f"copy {rec['copy_gbs']:.0f} GB/s (read + write), dense fp8 {rec['dense_fp8_tflops']:.0f} "
          f"TFLOP/s (8192^3 torch._scaled_mm)", file=sys.stderr)
    # Variants: (name, environment an Experts reads when it is created).
    variants = []
    for tiles in [t for t in a.tiles.split(",") if t] or ["auto"]:
        for split in [v for v in a.split_k.split(",") if v] or [None]:
            env = {"MOELINK_EXPERTS_TILES": None if tiles == "auto" else tiles,
                   "MOELINK_EXPERTS_SPLIT_K": split}
            variants.append((tiles if split is None else f"{tiles}+splitk-{split}", env))
    for spec in a.env:
        var, _, values = spec.partition("=")
        if not var or not values:
            p.error(f"--env {spec!r}: expected VAR=V1,V2,...")
        variants = [(f"{name}+{var}={v}", {**env, var: v})
                    for name, env in variants for v in values.split(",")]
    env_vars = sorted({k for _, env in variants for k in env})
    rec["tiles"] = [name for name, _ in variants]
    rows = []
    for L in [int(v) for v in a.experts.split(",") if v]:
        for m in [int(v) for v in a.rows.split(",") if v]:
            C = max(16, (m + 15) // 16 * 16)
            cases = {}
            for name, env in variants:
                apply_env(env)
                ex = moelink.Experts(L, C, H, I, expected_rows=m)
                cases[name] = Case(L, m, H, I, ex, shared=next(iter(cases.values()), None))
            apply_env(dict.fromkeys(env_vars))  # every variable back to unset
            first = next(iter(cases.values()))
            errs = {t: c.check() for t, c in cases.items()}
            require_close(errs, 5e-2, f"L={L} m={m} forward")  # measured: 2e-3 to 7e-3
            kinds = ("forward", "gemm1", "silu", "gemm2")
            times = {t: {k: [] for k in kinds} for t in cases}
            times["torch"] = {"layer": [], "gemm1": [], "gemm2": []}
            for _ in range(a.rounds):  # interleaved: every implementation each round
                for t, c in cases.items():
                    for k in kinds:
                        times[t][k].append(graph_us(getattr(c, k), a.iters))
                times["torch"]["layer"].append(graph_us(first.torch_layer, a.iters))
                times["torch"]["gemm1"].append(graph_us(first.torch_gemm1, a.iters))
                times["torch"]["gemm2"].append(graph_us(first.torch_gemm2, a.iters))
            med = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in times.items()}
            floor_us = first.floor_bytes() / (rec["copy_gbs"] * 1e9) * 1e6
            r = {"experts": L, "rows_per_expert": m, "rows_allocated": C,
                 "floor_bytes": first.floor_bytes(), "floor_us": floor_us, "flops": first.flops(),
                 "torch_us": med["torch"], "torch_us_rounds": times["torch"],
                 "torch_tflops": first.flops() / (med["torch"]["layer"] * 1e-6) / 1e12,
                 "ours": {}}
            for t in cases:
                fwd = med[t]["forward"]
                r["ours"][t] = {
                    "rel_l2_vs_torch_fp32": errs[t], "us": med[t], "us_rounds": times[t],
                    "forward_over_floor": fwd / floor_us,
                    "torch_over_forward": med["torch"]["layer"] / fwd,
                    "tflops": first.flops() / (fwd * 1e-6) / 1e12,
                    "fraction_of_dense_peak": first.flops() / (fwd * 1e-6) / 1e12 / rec["dense_fp8_tflops"],
                    "silu_gbs": L * m * (2 * I * 2 + I + I // 128 * 4) / (med[t]["silu"] * 1e-6) / 1e9,
                }
                o = r["ours"][t]
                print(f"L={L:2d} m={m:5d} {t:18s} ours {fwd:8.1f} us (gemm1 {med[t]['gemm1']:7.1f} "
                      f"silu {med[t]['silu']:6.1f} gemm2 {med[t]['gemm2']:7.1f})  torch "
                      f"{med['torch']['layer']:8.1f}  floor {floor_us:7.1f}  ours/floor "
                      f"{o['forward_over_floor']:5.2f}  torch/ours {o['torch_over_forward']:5.2f}  "
                      f"{o['tflops']:6.0f} TFLOP/s ({o['fraction_of_dense_peak']:.2f} of peak)  "
                      f"err {errs[t]:.1e}", file=sys.stderr)
            rows.append(r)
            del cases, first
            torch.cuda.empty_cache()
    rec["results"] = rows
    rec["dense"] = dense_results(a, variants, env_vars, rec["dense_fp8_tflops"])

    # The quantization kernels on large tensors: bytes read + written per second.
    q = []
    ex = moelink.Experts(8, 4096, H, I, expected_rows=4096)
    for M, K in ((16384, 7168), (65536, 2048)):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        xq = torch.empty(M, K, dtype=FP8, device="cuda")
        xs = torch.empty(M, K // 128, dtype=torch.float32, device="cuda")
        us = statistics.median(graph_us(lambda: ex.quantize(xq, xs, x), a.iters)
                               for _ in range(a.rounds))
        moved = M * K * 2 + M * K + M * K // 128 * 4
        q.append({"kernel": "quantize", "rows": M, "cols": K, "us": us,
                  "gbs": moved / (us * 1e-6) / 1e9})
    L, C = 8, 4096
    gu = torch.randn(L, C, 2 * I, device="cuda").to(torch.bfloat16)
    cnt = torch.full((L,), C, dtype=torch.int32, device="cuda")
    act = torch.empty(L, C, I, dtype=FP8, device="cuda")
    act_s = torch.empty(L, C, I // 128, dtype=torch.float32, device="cuda")
    us = statistics.median(graph_us(lambda: ex.silu_mul_quant(act, act_s, gu, cnt), a.iters)
                           for _ in range(a.rounds))
    moved = L * C * (2 * I * 2 + I + I // 128 * 4)
    q.append({"kernel": "silu_mul_quant", "rows": L * C, "cols": I, "us": us,
              "gbs": moved / (us * 1e-6) / 1e9})
    for e in q:
        e["fraction_of_copy"] = e["gbs"] / rec["copy_gbs"]
        print(f"{e['kernel']:15s} {e['rows']:6d} x {e['cols']:5d}: {e['us']:8.1f} us "
              f"{e['gbs']:6.0f} GB/s = {e['fraction_of_copy']:.2f} of copy", file=sys.stderr)
    rec["quant_kernels"] = q
    write_json(rec, a.json)


if __name__ == "__main__":
    main()
