#!/usr/bin/env python3
"""kv_bench: moelink's KV-cache transfer next to NIXL and Mooncake, in one run.

    python3 tools/bench/kv_bench --out bench/results/<date>_kv_bench_cpu-vm.json \\
        --svg bench/results/<date>_kv_bench_cpu-vm.svg
    python3 tools/bench/kv_bench --quick --engines nixl,mooncake --out /tmp/q.json

Every case (model x request tokens x concurrency) x transport class (shm,
tcp) x engine, for R rounds; each round runs the engines in an order rotated
by one, and each (engine, case, round) is a fresh pair of processes
(prefill, decode) on this host's loopback, so noise hits all engines alike.
Each engine uses its best transport of the class here (runner.TRANSPORTS):
moelink libfabric shm / tcp; NIXL UCX sm / tcp; Mooncake tcp (it has no
shared-memory transport here: runner.UNAVAILABLE). Every page of every
request is verified (common.verify_and_clear). An engine that cannot run
here is probed once and recorded with the reason; the run goes on without it.
Output: JSON (date, machine, commit, command, engine versions, every cell,
summaries; see report.py) and an SVG chart.

Bench-only requirements (pip; not build dependencies of moelink):
    # numpy
    # xxhash
    # nixl                                  (1.5.1: nixl-cu12/-cu13 wheels with UCX inside)
    # mooncake-transfer-engine-non-cuda     (0.3.13.post1; or mooncake-transfer-engine)
    # moelink's Python package with the TransferEngine binding (build/python,
    #   MOELINK_PYTHONPATH or installed)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import common  # noqa: E402
import report  # noqa: E402
import runner  # noqa: E402


def machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {"hostname": platform.node(), "kernel": platform.release(),
                            "python": platform.python_version(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            kb = int(next(l for l in f if l.startswith("MemTotal")).split()[1])
            info["ram_gib"] = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info


def git_commit() -> Dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def build_cases(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every case with either a Case to run or the reason it is skipped."""
    out = []
    for model in args.models:
        for tokens in args.tokens:
            for conc in args.concurrency:
                for tr in args.transports:
                    case = common.model_case(model, tokens, conc, tr, src_pool_pages=args.src_pool_pages,
                                             seed=args.seed,
                                             engine_options={"mooncake_notify": args.mooncake_notify})
                    warmup, iters = common.scale_iterations(case, args.target_gb * 1e9)
                    case.warmup = args.warmup if args.warmup is not None else warmup
                    case.iters = args.iters if args.iters is not None else iters
                    skip = common.budget_skip_reason(case, args.mem_budget_gib)
                    out.append({"case": case, "skip": skip})
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in csv(s)]  # noqa: E731
    ap.add_argument("--engines", type=csv, default=list(runner.ENGINES))
    ap.add_argument("--models", type=csv, default=list(common.MODELS))
    ap.add_argument("--tokens", type=ints, default=list(common.REQUEST_TOKENS))
    ap.add_argument("--concurrency", type=ints, default=list(common.CONCURRENCY))
    ap.add_argument("--transports", type=csv, default=list(common.TRANSPORT_CLASSES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: deepseek-v3, 1024 tokens, concurrency 1 and 16, 2 rounds")
    ap.add_argument("--mem-budget-gib", type=float, default=common.DEFAULT_MEM_BUDGET_GIB,
                    help="skip cases whose destination pool exceeds this")
    ap.add_argument("--src-pool-pages", type=int, default=common.DEFAULT_SRC_POOL_PAGES)
    ap.add_argument("--target-gb", type=float, default=1.5, help="timed GB per cell (sets iterations)")
    ap.add_argument("--iters", type=int, help="timed iterations per cell (default: scaled)")
    ap.add_argument("--warmup", type=int, help="warm-up iterations per cell (default: 1-2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", default="moelink", help="engine the ratios are relative to")
    ap.add_argument("--mooncake-notify", choices=("control", "engine"), default="control",
                    help="Mooncake: notice on the control socket (SGLang-style) or its TransferNotify")
    ap.add_argument("--cell-timeout", type=float, help="seconds per cell (default: scaled)")
    ap.add_argument("--op-timeout", type=float, default=60.0, help="workers' wait for a peer/engine")
    ap.add_argument("--out", required=True, help="result JSON (e.g. bench/results/<date>_kv_bench.json)")
    ap.add_argument("--svg", help="chart (default: --out with .svg)")
    ap.add_argument("--logs", help="folder for the workers' logs and results (default: a temp folder)")
    args = ap.parse_args()
    if args.quick:
        args.models, args.tokens, args.concurrency = ["deepseek-v3"], [1024], [1, 16]
        if "--rounds" not in sys.argv:
            args.rounds = 2
    for m in args.models:
        if m not in common.MODELS:
            ap.error(f"unknown model {m!r} (known: {', '.join(common.MODELS)})")
    for e in args.engines:
        if e not in runner.ENGINES:
            ap.error(f"unknown engine {e!r} (known: {', '.join(runner.ENGINES)})")
    return args


def main() -> int:
    args = parse_args()
    logs = args.logs or tempfile.mkdtemp(prefix="kv_bench.")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    svg_path = args.svg or os.path.splitext(args.out)[0] + ".svg"
    started = datetime.datetime.now(datetime.timezone.utc)

    probes = {e: runner.probe_engine(e) for e in args.engines}
    engines = [e for e in args.engines if probes[e].get("ok")]
    for e in args.engines:
        print(f"kv_bench: {e}: " + (json.dumps(probes[e].get("version")) if probes[e].get("ok")
                                    else f"CANNOT RUN: {probes[e].get('error')}"), flush=True)
    cases = build_cases(args)
    doc: Dict[str, Any] = {
        "benchmark": "kv_bench", "date": started.isoformat(timespec="seconds"), "machine": machine(),
        "git": git_commit(), "command": shlex.join([sys.executable] + sys.argv),
        "engines": probes, "engines_run": engines, "baseline": args.baseline,
        "transports": {e: {t: (v if v else {"unavailable": runner.UNAVAILABLE.get((e, t))})
                           for t, v in runner.TRANSPORTS[e].items()} for e in args.engines},
        "options": {k: v for k, v in vars(args).items() if k not in ("out", "svg")},
        "cases": [dict(json.loads(c["case"].to_json()), name=c["case"].name,
                       dst_pool_bytes=c["case"].dst_pool_bytes, iteration_bytes=c["case"].iteration_bytes,
                       **({"skipped": c["skip"]} if c["skip"] else {})) for c in cases],
        "cells": [],
    }
    runnable = [c["case"] for c in cases if not c["skip"]]
    for c in cases:
        if c["skip"]:
            print(f"kv_bench: skip {c['case'].name} {c['case'].transport}: {c['skip']}", flush=True)
    total = args.rounds * len(runnable) * len(engines)
    k = 0
    t0 = time.monotonic()
    for rnd in range(args.rounds):
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)] if engines else []
        for case in runnable:
            for eng in order:
                k += 1
                tag = f"r{rnd}-{eng}-{case.model}-{case.tokens}-c{case.concurrency}-{case.transport}"
                cell = runner.run_pair(eng, case, logs, tag, timeout_s=args.cell_timeout,
                                       op_timeout_s=args.op_timeout)
                cell["round"] = rnd
                doc["cells"].append(cell)
                if cell.get("skipped"):
                    status = "skipped"
                elif cell["ok"]:
                    d = cell["decode"]
                    status = (f"p50 {common.percentile(d['latency_ns'], 50) / 1e6:8.3f} ms  "
                              f"{sum(d['iteration_gbps']) / len(d['iteration_gbps']):6.3f} GB/s  "
                              f"verified {d['verified_pages']} pages")
                else:
                    status = "FAILED: " + cell.get("error", "?")[:200]
                print(f"[{k}/{total} {time.monotonic() - t0:6.0f}s] round {rnd} {case.name:24} "
                      f"{case.transport:3} {eng:8} {status}", flush=True)
                with open(args.out, "w") as f:  # partial results survive an interrupted run
                    json.dump(doc, f, indent=1)
    doc["summary"] = report.summarize(doc["cells"], args.baseline)
    for c in cases:  # budget-skipped cases appear in the table and chart too
        if c["skip"]:
            for eng in args.engines:
                doc["summary"].append({"engine": eng, "case": c["case"].name, "transport": c["case"].transport,
                                       "model": c["case"].model, "tokens": c["case"].tokens,
                                       "concurrency": c["case"].concurrency, "rounds": 0, "rounds_ok": 0,
                                       "skipped": True, "short": "over memory budget", "reason": c["skip"]})
    rank = {e: i for i, e in enumerate(args.engines)}
    doc["summary"].sort(key=lambda r: (r["model"], r["tokens"], r["concurrency"], r["transport"],
                                       rank.get(r["engine"], 99)))
    doc["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    doc["logs"] = logs
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(report.format_table(doc["summary"], args.baseline))
    m = doc["machine"]
    sub = (f"{started:%Y-%m-%d}, {m.get('cpu_model', '?')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB; "
           f"loopback, {args.rounds} rounds; commit {doc['git']['commit'][:10]}"
           f"{' (dirty)' if doc['git']['dirty'] else ''}")
    with open(svg_path, "w") as f:
        f.write(report.render_svg(doc["summary"], list(args.engines),
                                  "KV-cache transfer, prefill -> decode on one host", sub,
                                  {e: probes[e].get("error", "") for e in args.engines if e not in engines}))
    print(f"kv_bench: wrote {args.out} and {svg_path} (logs: {logs})")
    return 0 if all(c.get("ok") or c.get("skipped") for c in doc["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
