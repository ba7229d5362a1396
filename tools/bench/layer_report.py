#!/usr/bin/env python3
"""The MoE layer benchmark's report: tables and a stacked-bar SVG of what
tools/bench/layer_bench.py measured, beside what moelink-plan predicts for
the same layer (EP = the run's world size, one token per request, no MTP).

    python3 tools/bench/layer_report.py layer.json \\
        --plan build-plan/tools/plan/moelink-plan --svg layer.svg

Needs no GPU. Without --plan only the measurement is shown.
"""
import argparse
import json
import subprocess
import sys
from typing import Dict, List, Optional

from benchlib import stacked_bars_svg

STAGES = ("quantize_us", "router_us", "dispatch_send_us", "shared_expert_us", "dispatch_recv_us",
          "gemm1_us", "silu_mul_us", "gemm2_us", "combine_send_us", "combine_recv_us")


def stage_of_kernels(names):
    """The layer stage of each kernel of one forward (modes none and
    dispatch-overlap), from the kernels that open the stages: the input's
    quantization, the router, dispatch send / receive, the routed SiLU-mul
    and combine; what runs between them belongs to the stage before (the
    gate GEMM to the router, the shared expert's GEMMs and SiLU-mul after
    the router or the dispatch send, the routed GEMMs around the SiLU-mul).
    Kernels outside these (a CUDA graph's row staging) are "other_us"."""
    stages, state = [], "other_us"
    for n in names:
        if "GroupQuantInput)0" in n:
            stage, state = "quantize_us", "router_us"
        elif "router_kernel" in n:
            stage, state = "router_us", "shared_expert_us"
        elif "dispatch_kernel<true, false>" in n:
            stage = "dispatch_send_us"  # the shared expert may follow (dispatch-overlap)
        elif "dispatch_kernel<false, true>" in n:
            stage, state = "dispatch_recv_us", "gemm1_us"
        elif "GroupQuantInput)1" in n and state == "gemm1_us":
            stage, state = "silu_mul_us", "gemm2_us"
        elif "combine_kernel" in n:
            stage, state = ("combine_send_us", "other_us") if ", true, false>" in n else ("combine_recv_us", "other_us")
        elif "copy_rows_kernel" in n:
            stage = "other_us"
        else:
            stage = state
        stages.append(stage)
    return stages


# (label, measured stage keys, moelink-plan kernel names, colour), in layer order.
GROUPS = [
    ("quantize", ["quantize_us"], [], "#9e9e9e"),
    ("router", ["router_us"], ["router"], "#8d6e63"),
    ("dispatch", ["dispatch_send_us", "dispatch_recv_us"], ["dispatch"], "#42a5f5"),
    ("shared expert", ["shared_expert_us"], ["shared_gate_up", "shared_act", "shared_down"], "#ab47bc"),
    ("GEMM1", ["gemm1_us"], ["moe_gate_up"], "#ef6c00"),
    ("SiLU-mul", ["silu_mul_us"], ["moe_act_quant"], "#fdd835"),
    ("GEMM2", ["gemm2_us"], ["moe_down"], "#e53935"),
    ("combine", ["combine_send_us", "combine_recv_us"], ["combine"], "#26a69a"),
]


def measured_groups(stages: Dict[str, float]) -> Dict[str, float]:
    return {g: sum(stages.get(k, 0.0) for k in keys) for g, keys, _, _ in GROUPS}


def planned_groups(plan_bin: str, batch: int, model: str, ep: int = 1) -> Optional[Dict[str, float]]:
    """moelink-plan's per-kernel prediction for `batch` tokens per rank at EP `ep`."""
    cmd = [plan_bin, "--model", model, "--ep", str(ep), "--tp", "1", "--batch", str(batch), "--mtp", "0",
           "--overlap", "dispatch", "--ignore-memory", "--json", "-"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"layer_report: {' '.join(cmd)} failed: {res.stderr.strip()}", file=sys.stderr)
        return None
    layer = json.loads(res.stdout)["moe_layer"]
    times = {k["name"]: k["time_us"] for k in layer["kernels"]}
    times["dispatch"] = layer["dispatch"]["total_us"]
    times["combine"] = layer["combine"]["total_us"]
    return {g: sum(times.get(n, 0.0) for n in names) for g, _, names, _ in GROUPS}


def pick(results: List[dict], batch: int, mode: str, graphs: bool) -> Optional[dict]:
    for r in results:
        if r["batch"] == batch and r["mode"] == mode and r["graphs"] == graphs:
            return r
    return None


def fmt(v: Optional[float], spec: str = "8.1f") -> str:
    return format(v, spec) if v is not None else " " * (int(spec.split(".")[0]) - 1) + "-"


def print_tables(rec: dict, plans: Dict[int, Dict[str, float]]) -> None:
    res = rec["results"]
    print(f"{rec['model']['name']} MoE layer, world {rec['world_size']}, {rec['gpu']}, "
          f"copy {rec['copy_gbs']:.0f} GB/s, commit {rec['git_commit']}")
    print("\nwall time (us): wall / sum of kernels (gaps) and wall / HBM floor")
    print(f"{'batch':>5} {'mode':16} {'run':5} {'wall':>8} {'kernels':>8} {'busy':>8} {'floor':>8} "
          f"{'w/kern':>6} {'w/floor':>7}")
    for r in res:
        print(f"{r['batch']:5d} {r['mode']:16} {'graph' if r['graphs'] else 'eager':5} "
              f"{r['wall_us']:8.1f} {fmt(r.get('sum_of_kernels_us'))} {fmt(r.get('busy_us'))} "
              f"{r['floor_us']:8.1f} {fmt(r.get('wall_over_kernels'), '6.2f')} {r['wall_over_floor']:7.2f}")
    names = [g for g, _, _, _ in GROUPS]
    print("\nstages (us), eager, mode none: 'gpu' kernel time per stage (torch.profiler), 'marks' the\n"
          "time between the layer's stage marks (with the host's launch gaps), 'plan' moelink-plan's\n"
          "prediction, 'p/g' plan / gpu")
    print(f"{'batch':>5} {'':5} " + " ".join(f"{n:>9}" for n in names) + f" {'sum':>9}")
    for b in sorted({r["batch"] for r in res}):
        r = pick(res, b, "none", False)
        if r and r.get("stages_us"):
            m = measured_groups(r["stages_us"])
            print(f"{b:5d} {'gpu':5} " + " ".join(f"{m[n]:9.1f}" for n in names) + f" {sum(m.values()):9.1f}")
        if r and r.get("stage_marks_us"):
            k = measured_groups(r["stage_marks_us"])
            print(f"{'':5} {'marks':5} " + " ".join(f"{k[n]:9.1f}" for n in names) + f" {sum(k.values()):9.1f}")
        if b in plans:
            p = plans[b]
            print(f"{'':5} {'plan':5} " + " ".join(f"{p[n]:9.1f}" for n in names) + f" {sum(p.values()):9.1f}")
            if r and r.get("stages_us"):
                print(f"{'':5} {'p/g':5} " + " ".join(
                    f"{p[n] / m[n]:9.2f}" if m[n] > 0 else f"{'-':>9}" for n in names) +
                    f" {sum(p.values()) / sum(m.values()):9.2f}")


def write_svg(path: str, rec: dict, plans: Dict[int, Dict[str, float]]) -> None:
    """One row per batch: the measured stages (eager, mode none) and, below,
    moelink-plan's prediction, as horizontal stacked bars on the row's own
    scale (the times span two orders of magnitude); totals in microseconds."""
    rows = []
    for b in sorted({r["batch"] for r in rec["results"]}):
        r = pick(rec["results"], b, "none", False)
        bars = []
        if r and r.get("stages_us"):
            bars.append(("measured", measured_groups(r["stages_us"])))
        if b in plans:
            bars.append(("moelink-plan", plans[b]))
        if bars:
            rows.append((b, bars))
    title = f'{rec["model"]["name"]} MoE layer on one {rec["gpu"]}: measured stages vs moelink-plan'
    subtitle = (f'eager, overlap none, world {rec["world_size"]}, each row on its own scale; kernel time per stage '
                f'(torch.profiler); {rec["date"][:10]}, commit {rec["git_commit"]}')
    stacked_bars_svg(path, title, subtitle, [(f'{b} token{"s" if b > 1 else ""}', bars) for b, bars in rows],
                     [(g, colour) for g, _, _, colour in GROUPS])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="layer_bench.py's JSON")
    p.add_argument("--plan", help="the moelink-plan binary (adds its prediction)")
    p.add_argument("--svg", help="write the stacked-bar chart here")
    a = p.parse_args()
    try:
        with open(a.json) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"layer_report: {a.json}: {e}")
    if not isinstance(rec, dict) or not isinstance(rec.get("results"), list) or "model" not in rec:
        sys.exit(f"layer_report: {a.json}: no \"results\" list and \"model\" (is it layer_bench.py --json output?)")
    plans = {}
    if a.plan:
        for b in sorted({r["batch"] for r in rec["results"]}):
            g = planned_groups(a.plan, b, rec["model"].get("preset", rec["model"]["name"].lower()),
                               ep=int(rec.get("world_size", 1)))
            if g:
                plans[b] = g
    print_tables(rec, plans)
    if a.svg:
        write_svg(a.svg, rec, plans)


if __name__ == "__main__":
    main()
