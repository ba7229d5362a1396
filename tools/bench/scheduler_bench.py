#!/usr/bin/env python3
"""Trace replay benchmark of moelink-scheduler's policies against sglang-router.

Every policy replays the same trace (tools/bench/scheduler_traces.py) on a
fresh set of simulated engines (moelink-engine-sim, times from moelink-plan's
DeepSeek-V3 model, scaled by --time-scale so a run takes tens of seconds):

  moelink/<policy>   moelink-scheduler --policy <policy>, clients over gRPC
  sglang/<policy>    sglang-router --policy <policy> (PyPI sglang-router), the
                     same simulators behind their SGLang-compatible HTTP API,
                     prompts sent as text (one code point per token, so the
                     router's character radix tree sees the token structure)

Per run: KV cache hit rate (prompt tokens found cached, from the engines'
records), time to first token and end-to-end latency (mean, p50, p99; as the
client sees them, in model time = wall time / time scale; and as the engines
see them), load imbalance (max / mean over engines of the tokens they hold,
sampled every 250 ms, averaged over the run), scheduling decisions per second
and decision latency (moelink: its own counters; sglang-router exposes none).
The floor the benchmark computes itself: the ideal hit rate (every prompt
finds the longest prefix any earlier prompt had, an infinite shared cache)
and the ideal TTFT (that uncached remainder's prefill alone, no queueing).
Also runs moelink-scheduler-bench (saturated decisions, one core).

    python3 tools/bench/scheduler_bench.py --bin-dir build/tools/scheduler \\
        --out bench/results/<date>_cpu_scheduler.json --svg-dir bench/results

Needs grpcio, xxhash, aiohttp and sglang-router (pip), the moelink Python
package on the path (MOELINK_PYTHONPATH or installed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
for p in reversed(os.environ.get("MOELINK_PYTHONPATH", "").split(os.pathsep)):
    if p:
        sys.path.insert(0, os.path.abspath(p))

import scheduler_traces  # noqa: E402
from moelink.scheduler import AsyncSchedulerClient, CodepointTokenizer, SchedulerClient  # noqa: E402
from moelink.scheduler.local_cluster import LocalCluster, find_binary  # noqa: E402

TOKENIZER = CodepointTokenizer()


# ------------------------------------------------------------------ drivers
class Record(dict):
    """One request as the client saw it: t_submit, t_first, t_done (wall s),
    prompt, output, cached, engine, error."""


class MoelinkDriver:
    def __init__(self, target: str, stream_interval: int):
        self.client = AsyncSchedulerClient(target)
        self.stream_interval = stream_interval

    async def run(self, prompt: List[int], max_new: int, session: str) -> Record:
        rec = Record(t_submit=time.time(), t_first=None, prompt=len(prompt), output=[], cached=0,
                     engine="", error=None)
        try:
            async for ev in self.client.generate(prompt, max_new_tokens=max_new, session_id=session,
                                                 stream_interval=self.stream_interval,
                                                 ignore_eos=True):
                kind = ev.WhichOneof("kind")
                if kind == "tokens":
                    if rec["t_first"] is None:
                        rec["t_first"] = time.time()
                    rec["output"].extend(ev.tokens.token_ids)
                elif kind == "finished":
                    rec["cached"], rec["engine"] = ev.finished.cached_tokens, ev.finished.engine_id
        except Exception as e:  # recorded, counted, reported
            rec["error"] = str(e)
        rec["t_done"] = time.time()
        return rec

    async def close(self):
        await self.client.close()


class SglangDriver:
    def __init__(self, url: str):
        import aiohttp
        self.url = url
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def run(self, prompt: List[int], max_new: int, session: str) -> Record:
        rec = Record(t_submit=time.time(), t_first=None, prompt=len(prompt), output=[], cached=0,
                     engine="", error=None)
        body = {"text": TOKENIZER.decode(prompt), "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
        try:
            async with self.session.post(self.url + "/generate", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                buf = b""
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        line, buf = buf.split(b"\n\n", 1)
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if data.get("output_ids"):
                            if rec["t_first"] is None:
                                rec["t_first"] = time.time()
                            rec["output"].extend(data["output_ids"])
                        rec["cached"] = data.get("meta_info", {}).get("cached_tokens", rec["cached"])
        except Exception as e:
            rec["error"] = str(e)
        rec["t_done"] = time.time()
        return rec

    async def close(self):
        await self.session.close()


async def replay(trace: scheduler_traces.Trace, driver, time_scale: float,
                 request_timeout_s: float = 120.0) -> List[Record]:
    """Replays the trace's sessions; a request unanswered after
    request_timeout_s (wall) is recorded as an error and ends its session,
    so a stuck system fails its cells instead of hanging the run."""
    records: List[Record] = []
    t0 = time.time()

    async def session(s: scheduler_traces.Session):
        await asyncio.sleep(max(0.0, t0 + s.start_s * time_scale - time.time()))
        context: List[int] = []
        for turn in s.turns:
            if turn.think_s:
                await asyncio.sleep(turn.think_s * time_scale)
            prompt = context + turn.new_tokens
            try:
                rec = await asyncio.wait_for(driver.run(prompt, turn.max_new_tokens, s.session_id),
                                             request_timeout_s)
            except asyncio.TimeoutError:
                rec = Record(t_submit=time.time() - request_timeout_s, t_first=None, prompt=len(prompt),
                             output=[], cached=0, engine="", t_done=time.time(),
                             error=f"no answer within {request_timeout_s:.0f} s")
            rec["session"] = s.session_id
            records.append(rec)
            if rec["error"]:
                return
            context = prompt + rec["output"]

    await asyncio.gather(*(session(s) for s in trace.sessions))
    for r in records:
        r["t0"] = t0
    return records


# ------------------------------------------------------------------ metrics
def pct(values: List[float], p: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p * (len(v) - 1))))]


def summary(values: List[float]) -> Dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": statistics.fmean(values), "p50": pct(values, 0.5), "p99": pct(values, 0.99)}


def imbalance(engine_stats: Dict[str, dict]) -> Dict:
    """max/mean of the tokens engines hold, per 250 ms bucket, over buckets
    where the mean is > 0."""
    buckets: Dict[int, Dict[str, int]] = {}
    for eid, st in engine_stats.items():
        for t_us, active, *_ in st.get("load_samples", []):
            buckets.setdefault(int(t_us // 250000), {})[eid] = active
    n = len(engine_stats)
    ratios = []
    for b in sorted(buckets):
        vals = list(buckets[b].values()) + [0] * (n - len(buckets[b]))
        mean = sum(vals) / n
        if mean > 0:
            ratios.append(max(vals) / mean)
    return {"mean": statistics.fmean(ratios) if ratios else None, "p99": pct(ratios, 0.99),
            "samples": len(ratios)}


def ideal_floor(prompts: List[List[int]], block: int, prefill) -> Dict:
    """Ideal hit rate and TTFT: each prompt finds the longest block prefix any
    earlier prompt (in submission order) had; its TTFT is the remainder's
    prefill alone."""
    seen = set()
    cached_total = prompt_total = 0
    ttfts = []
    for prompt in prompts:
        h, matched, chain = 0, 0, []
        for b in range(len(prompt) // block):
            h = hash((h, tuple(prompt[b * block:(b + 1) * block])))
            chain.append(h)
        for h in chain:
            if h not in seen:
                break
            matched += 1
        seen.update(chain)
        cached = min(len(prompt) - 1, matched * block)
        cached_total += cached
        prompt_total += len(prompt)
        ttfts.append(prefill(len(prompt) - cached) / 1e3)
    return {"hit_rate": cached_total / max(1, prompt_total), "ttft_ms": summary(ttfts)}


def prefill_function(engine_stats: Dict[str, dict]):
    table = next(iter(engine_stats.values()))["cost_model"]["prefill_table"]

    def prefill_us(tokens: float) -> float:
        if tokens <= table[0][0]:
            return table[0][1]
        for (x0, y0), (x1, y1) in zip(table, table[1:]):
            if tokens <= x1:
                return y0 + (tokens - x0) / (x1 - x0) * (y1 - y0)
        (x0, y0), (x1, y1) = table[-2], table[-1]
        return y1 + (tokens - x1) / (x1 - x0) * (y1 - y0)
    return prefill_us


def metrics(records: List[Record], engine_stats: Dict[str, dict], time_scale: float) -> Dict:
    ok = [r for r in records if not r["error"]]
    ttft = [(r["t_first"] - r["t_submit"]) * 1e3 / time_scale for r in ok if r["t_first"]]
    e2e = [(r["t_done"] - r["t_submit"]) * 1e3 / time_scale for r in ok]
    eng_req = [q for st in engine_stats.values() for q in st.get("requests", [])]
    cached = sum(q["cached_tokens"] for q in eng_req)
    prompt = sum(q["prompt_tokens"] for q in eng_req)
    eng_ttft = [(q["first_token_us"] - q["arrival_us"]) / 1e3 / time_scale for q in eng_req
                if q["first_token_us"]]
    per_engine = sorted(len(st.get("requests", [])) for st in engine_stats.values())
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_examples": [r["error"] for r in records if r["error"]][:3],
        "hit_rate": cached / max(1, prompt),
        "ttft_ms": summary(ttft),
        "e2e_ms": summary(e2e),
        "engine_ttft_ms": summary(eng_ttft),
        "imbalance": imbalance(engine_stats),
        "requests_per_engine": {"min": per_engine[0] if per_engine else 0,
                                "max": per_engine[-1] if per_engine else 0},
    }


def ttft_series(records: List[Record], time_scale: float, bucket_s: float) -> List[List[float]]:
    """(seconds since start in model time, mean TTFT in model ms) per bucket."""
    buckets: Dict[int, List[float]] = {}
    for r in records:
        if r["error"] or not r["t_first"]:
            continue
        t = (r["t_submit"] - r["t0"]) / time_scale
        buckets.setdefault(int(t // bucket_s), []).append((r["t_first"] - r["t_submit"]) * 1e3 / time_scale)
    return [[(b + 0.5) * bucket_s, statistics.fmean(v)] for b, v in sorted(buckets.items())]


# ------------------------------------------------------------------ runs
def start_sglang_router(cluster: LocalCluster, policy: str, workdir: str):
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    urls = [cluster.http_url(i) for i in range(cluster.num_engines)]
    log = open(os.path.join(workdir, f"sglang-router-{policy}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                             "--port", str(port), "--policy", policy, "--log-level", "warn",
                             "--worker-urls", *urls], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {proc.returncode}; see {log.name}")
        try:
            body = json.dumps({"input_ids": [1001, 1002], "sampling_params": {"max_new_tokens": 1}}).encode()
            req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except Exception:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"sglang-router not serving within 60 s; see {log.name}")
        time.sleep(0.2)


def run_one(system: str, policy: str, trace, args, workdir: str) -> Dict:
    sim_args = ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    with LocalCluster(engines=args.engines, policy=policy if system == "moelink" else "ttft",
                      bin_dir=args.bin_dir, block_size=args.block_size, kv_blocks=args.kv_blocks,
                      max_batch=args.max_batch, time_scale=args.time_scale,
                      scheduler=(system == "moelink"), http=(system == "sglang"),
                      stream_interval=args.stream_interval, sim_args=sim_args,
                      scheduler_args=shlex.split(args.scheduler_args),
                      workdir=os.path.join(workdir, f"{trace.name}-{system}-{policy}")) as cluster:
        router = None
        try:
            if system == "sglang":
                router, url = start_sglang_router(cluster, policy, cluster.dir)

            async def go():
                # Created inside the event loop (grpc.aio and aiohttp need one).
                driver = (MoelinkDriver(cluster.target, args.stream_interval) if system == "moelink"
                          else SglangDriver(url))
                try:
                    return await replay(trace, driver, args.time_scale)
                finally:
                    await driver.close()
            t = time.time()
            records = asyncio.run(go())
            wall = time.time() - t
            decisions = None
            if system == "moelink":
                with SchedulerClient(cluster.target) as c:
                    s = c.stats()
                decisions = {"decisions": s.decisions, "per_s_during_run": s.decisions / wall,
                             "p50_us": s.decision_p50_us, "p99_us": s.decision_p99_us,
                             "max_us": s.decision_max_us, "rerouted": s.rerouted, "failed": s.failed}
        finally:
            if router:
                router.terminate()
                router.wait(timeout=30)
        engine_stats = cluster.stop()
    m = metrics(records, engine_stats, args.time_scale)
    m["wall_s"] = wall
    m["decisions"] = decisions if decisions else {
        "note": "sglang-router exposes no per-decision timing or count; not measured"}
    m["ttft_over_time"] = ttft_series(records, args.time_scale, args.bucket_s)
    m["_records"] = records
    m["_engine_stats"] = engine_stats
    return m


# ------------------------------------------------------------------ SVG
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]


def write_svg(path: str, title: str, series: Dict[str, List[List[float]]]) -> None:
    W, H, L, R, T, B = 820, 420, 70, 190, 40, 50
    pts = [p for s in series.values() for p in s]
    if not pts:
        return
    xmax = max(p[0] for p in pts) or 1
    ymax = max(p[1] for p in pts) or 1
    nice = 10 ** int(f"{ymax:e}".split("e")[1])
    ymax = ((ymax // nice) + 1) * nice

    def X(x):
        return L + (W - L - R) * x / xmax

    def Y(y):
        return H - B - (H - T - B) * y / ymax
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{title}</text>']
    for i in range(6):
        y = ymax * i / 5
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(y):.1f}" y2="{Y(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:,.0f}</text>')
    for i in range(6):
        x = xmax * i / 5
        out.append(f'<text x="{X(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:,.0f}</text>')
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" stroke="black"/>')
    out.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" stroke="black"/>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">time since the first '
               f'request (s, model time)</text>')
    out.append(f'<text transform="translate(18,{(T + H - B) / 2}) rotate(-90)" text-anchor="middle">'
               f'mean time to first token (ms)</text>')
    for k, (name, s) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{d}"/>')
        ly = T + 10 + 20 * k
        out.append(f'<line x1="{W - R + 15}" x2="{W - R + 40}" y1="{ly}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="3"/><text x="{W - R + 46}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


# ------------------------------------------------------------------ main
def machine() -> Dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"host": platform.node(), "os": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu,
            "python": platform.python_version()}


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "tools", "scheduler"))
    ap.add_argument("--traces", default="shared-prefix,multi-turn,mooncake")
    ap.add_argument("--policies", default="ttft,prefix-only,least-loaded,round-robin",
                    help="moelink-scheduler policies")
    ap.add_argument("--sglang-policies", default="cache_aware,round_robin",
                    help="sglang-router policies ('' to skip)")
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="engine times and trace times are multiplied by this")
    ap.add_argument("--kv-blocks", type=int, default=8192, help="per engine (x block size tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--stream-interval", type=int, default=16)
    ap.add_argument("--bucket-s", type=float, default=5.0, help="TTFT-over-time bucket (model s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiplies each trace's arrival rate")
    ap.add_argument("--scheduler-args", default="",
                    help="extra moelink-scheduler options, e.g. '--miss-weight 2'")
    ap.add_argument("--out", default="")
    ap.add_argument("--svg-dir", default="")
    ap.add_argument("--workdir", default="/tmp/moelink-scheduler-bench")
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    result = {"benchmark": "scheduler trace replay", "date": datetime.date.today().isoformat(),
              "machine": machine(), "commit": commit(),
              "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "svg_dir", "workdir")},
              "traces": {}}
    # Saturated decision rate, one core.
    bench = find_binary("moelink-scheduler-bench", args.bin_dir)
    if bench:
        result["decision_bench"] = json.loads(subprocess.check_output([bench, "--engines", str(args.engines)]))
        print("decisions (saturated, one core):", json.dumps(result["decision_bench"]), flush=True)
    sglang_ok = True
    try:
        import aiohttp  # noqa: F401
        import sglang_router  # noqa: F401
    except ImportError as e:
        sglang_ok = False
        result["sglang_router"] = f"not run: {e} (pip install sglang-router aiohttp)"
    runs = [("moelink", p) for p in args.policies.split(",") if p]
    if sglang_ok:
        runs += [("sglang", p) for p in args.sglang_policies.split(",") if p]
    for name in args.traces.split(","):
        make = scheduler_traces.TRACES[name]
        kw = {"seed": args.seed}
        trace = make(**kw)
        if args.rate_scale != 1.0:
            for s in trace.sessions:
                s.start_s /= args.rate_scale
            trace.params["rate_scale"] = args.rate_scale
        entry = {"params": trace.params, "source": trace.source, "requests": trace.requests(), "runs": {}}
        series = {}
        reference = None  # the first clean run's records and engine stats, for the floor
        for system, policy in runs:
            label = f"{system}/{policy}"
            print(f"== {name}: {label}", flush=True)
            m = run_one(system, policy, trace, args, args.workdir)
            records, engine_stats = m.pop("_records"), m.pop("_engine_stats")
            if reference is None and not m["errors"]:
                reference = (sorted(records, key=lambda r: r["t_submit"]), engine_stats)
            entry["runs"][label] = m
            series[label] = m["ttft_over_time"]
            print(json.dumps({k: m[k] for k in ("hit_rate", "ttft_ms", "e2e_ms", "imbalance", "errors",
                                                "decisions")}, default=str), flush=True)
        if reference:
            ordered, stats = reference
            entry["floor"] = ideal_floor(_prompts_of(trace, ordered), args.block_size,
                                         prefill_function(stats))
        result["traces"][name] = entry
        if args.svg_dir:
            os.makedirs(args.svg_dir, exist_ok=True)
            write_svg(os.path.join(args.svg_dir, f"{result['date']}_cpu_scheduler_ttft_{name}.svg"),
                      f"Time to first token over time: {name} trace, {args.engines} simulated engines",
                      series)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print("wrote", args.out)
    return 0


def _prompts_of(trace, ordered: List[Record]) -> List[List[int]]:
    """Rebuilds every prompt (multi-turn contexts include the engines' outputs)."""
    by_session: Dict[str, List[Record]] = {}
    for r in ordered:
        by_session.setdefault(r["session"], []).append(r)
    sessions = {s.session_id: s for s in trace.sessions}
    prompt_of = {}
    for sid, recs in by_session.items():
        context: List[int] = []
        for turn, r in zip(sessions[sid].turns, recs):
            prompt = context + turn.new_tokens
            prompt_of[id(r)] = prompt
            context = prompt + r["output"]
    return [prompt_of[id(r)] for r in ordered]


if __name__ == "__main__":
    sys.exit(main())
