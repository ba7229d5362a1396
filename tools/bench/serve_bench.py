#!/usr/bin/env python3
"""moelink-serve-bench: moelink-serve (python -m moelink.serve) under load,
with the scheduler benchmark's request traces.

    python3 tools/bench/serve_bench.py --model DIR --serve-args "--backend nvlink --cuda-graphs ..." \\
        --json serve.json [--model-bench model.json]
    python3 tools/bench/serve_bench.py --url http://127.0.0.1:8000/v1 --json serve.json

With --model the benchmark starts the server itself, once with prefix
caching and once with --no-prefix-caching (--cache on,off), and stops it
after; with --url it loads a running server as it is. Per trace
(--traces: shared-prefix, SGLang's generated-shared-prefix shape;
multi-turn, vLLM's multi-turn generator shape; tools/bench/scheduler_traces.py)
and concurrency C (--concurrency), a cell sends --requests requests (at
least C; multi-turn: at least 4 C, as C sessions of turns), at most C in
flight (a closed loop; --rate R > 0: Poisson arrivals at R/s,
still at most C in flight; several rates: a cell per rate and concurrency), every one streamed (/v1/completions, token-id
prompts, ignore_eos, --max-tokens output tokens):
  output_tok_s       output tokens over the cell's wall time;
  ttft_ms, itl_ms    time to the first streamed token and between streamed
                     chunks, p50 and p99 over the cell's requests;
  cached_share       prompt tokens the prefix cache held (usage's
                     prompt_tokens_details.cached_tokens) over all prompt tokens;
  server             from /metrics before and after the cell (an engine in
                     the server's process): decode_step_us (the model's
                     decode-only steps inside the server), decode_batch
                     (requests such a step carried), decode_tok_s (their
                     tokens over their time), engine_step_us and
                     model_step_us (whole engine rounds and the model's
                     steps in them) and overhead_share = 1 - model / engine;
                     gil_wait_us: of an engine round, the wait for the GIL
                     after the step's C++ part;
                     graph_host_us / graph_wait_us: the graphed decode
                     steps' host clock until their work is queued / after
                     (model_bench.py reports the same split);
  vs_bare            with --model-bench (model_bench.py's JSON of the same
                     model): decode_step_us over the bare graphed step at the
                     nearest batch (q_len 1), minus 1.
Prompts: the trace's token ids mapped into the model's vocabulary; a
shared-prefix prompt is a system prompt shared by its group (8 requests)
plus a 128-token question, --context tokens in all; the multi-turn
generator's lengths scaled by --context / 5000 where that is below 1;
every cell its own prompts (another seed), none of them cached before; a multi-turn session's turns go in order
(each turn's prompt is the session's earlier prompts plus its new tokens:
the earlier answers are left out, the benchmark reads text, not ids; no
think time), a session ending where its context would pass --context.
A server the benchmark starts gets --max-model-len context + max-tokens
unless --serve-args names one.
"""
import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.parse

from benchlib import header, write_json
from scheduler_traces import multi_turn, shared_prefix


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100.0 * (len(v) - 1)))))]


class Server:
    """python -m moelink.serve started here (--model), or a running one (--url)."""

    def __init__(self, url=None, model=None, serve_args=(), log=None, timeout_s=900.0):
        self.proc = None
        if url is None:
            cmd = [sys.executable, "-m", "moelink.serve", "--model", model, "--port", "0", *serve_args]
            print(f"serve_bench: starting {' '.join(cmd)}", file=sys.stderr, flush=True)
            self.log = open(log or os.devnull, "w")
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
            deadline = time.time() + timeout_s
            url = None
            while url is None:
                line = self.proc.stdout.readline()
                if not line:
                    raise SystemExit(f"serve_bench: the server exited ({self.proc.wait()}) before it listened"
                                     + (f"; its log: {log}" if log else ""))
                m = re.search(r"on (http://\S+/v1)", line)
                if m:
                    url = m.group(1)
                elif time.time() > deadline:
                    self.stop()
                    raise SystemExit(f"serve_bench: the server did not listen within {timeout_s:.0f} s")
            threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.base = u.hostname, u.port, u.path.rstrip("/")
        models = self.get("/models")
        self.model_name = json.loads(models)["data"][0]["id"]

    def conn(self, timeout=600.0):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def get(self, path):
        c = self.conn(30.0)
        try:
            c.request("GET", (self.base if path != "/metrics" else "") + path)
            r = c.getresponse()
            return r.read().decode()
        finally:
            c.close()

    def metrics(self):
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()
                out[name] = float(value)
        return out

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stream_request(server, prompt, max_tokens):
    """One streamed completion: (ttft_s, [chunk gaps s], output tokens,
    cached prompt tokens, error or None)."""
    body = json.dumps({"model": server.model_name, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = server.conn()
    t0 = time.perf_counter()
    ttft, gaps, last, usage = None, [], None, None
    try:
        c.request("POST", server.base + "/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return None, [], 0, 0, f"HTTP {r.status}: {r.read().decode()[:200]}"
        while True:
            line = r.readline()
            if not line:
                return ttft, gaps, 0, 0, "the stream ended without [DONE]"
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                return ttft, gaps, 0, 0, ev["error"].get("message", "error")
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
    except (OSError, http.client.HTTPException) as e:
        return ttft, gaps, 0, 0, f"{type(e).__name__}: {e}"
    finally:
        c.close()
    if usage is None:
        return ttft, gaps, 0, 0, "no usage in the stream"
    return ttft, gaps, usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"], None


def trace_requests(name, count, context, vocab, max_tokens, seed):
    """The first `count` requests of a trace as sessions of prompts (token
    lists in [4, vocab)), each session's prompts in order."""
    cap = max(2, context)
    fit = lambda ids: [4 + t % (vocab - 4) for t in ids]  # noqa: E731
    if name == "shared-prefix":
        groups = max(1, count // 8)
        question = min(128, max(1, context // 4))
        tr = shared_prefix(seed=seed, groups=groups, prompts_per_group=-(-count // groups),
                           system_prompt_len=max(1, context - question), question_len=question,
                           output_len=max_tokens)
        return [[fit(s.turns[0].new_tokens)] for s in tr.sessions[:count]]
    if name == "multi-turn":
        f = min(1.0, context / 5000)  # the generator's lengths are for 5000-token contexts
        tr = multi_turn(seed=seed, sessions=max(1, count // 4), common_prefix=max(1, int(500 * f)),
                        session_prefix_mean=max(1, int(1000 * f)), session_prefix_max=context,
                        user_tokens=(max(1, int(120 * f)), max(1, int(160 * f))))
        # Every session's prompts (a session ends where its context would
        # pass the cap), then the first turns of all sessions, then their
        # second turns, ... until `count`: count // 4 sessions run side by side.
        turns = []
        for s in tr.sessions:
            ctx, prompts = [], []
            for t in s.turns:
                if len(ctx) + len(t.new_tokens) > cap:
                    break
                ctx = ctx + t.new_tokens
                prompts.append(fit(ctx))
            turns.append(prompts)
        sessions, n, k = [[] for _ in turns], 0, 0
        while n < count and any(k < len(p) for p in turns):
            for i, p in enumerate(turns):
                if k < len(p) and n < count:
                    sessions[i].append(p[k])
                    n += 1
            k += 1
        return [p for p in sessions if p]
    raise SystemExit(f"serve_bench: --traces: unknown trace {name!r} (shared-prefix, multi-turn)")


def run_cell(server, sessions, concurrency, max_tokens, rate, seed):
    """Sends every session's prompts (in order within a session), at most
    `concurrency` requests in flight; returns the cell's record."""
    lock = threading.Lock()
    queue = list(range(len(sessions)))
    results, prompt_tokens = [], [0]
    rng = random.Random(seed)
    starts = []
    t = 0.0
    for _ in sessions:
        t += rng.expovariate(rate) if rate > 0 else 0.0
        starts.append(t)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            wait = starts[i] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            for prompt in sessions[i]:
                r = stream_request(server, prompt, max_tokens)
                with lock:
                    results.append(r)
                    prompt_tokens[0] += len(prompt)

    before = server.metrics()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(min(concurrency, len(sessions)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    after = server.metrics()
    ok = [r for r in results if r[4] is None]
    errors = [r[4] for r in results if r[4] is not None]
    ttft = [r[0] * 1e3 for r in ok]
    itl = [g * 1e3 for r in ok for g in r[1]]
    out_tokens = sum(r[2] for r in ok)
    rec = {"concurrency": concurrency, "rate_per_s": rate, "requests": len(results), "completed": len(ok),
           "errors": len(errors), "error_examples": errors[:3], "wall_s": wall,
           "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
           "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
           "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
           "cached_share": sum(r[3] for r in ok) / max(1, prompt_tokens[0])}
    d = {k[len("moelink_"):-len("_total")]: after[k] - before.get(k, 0.0)
         for k in after if k.startswith("moelink_") and k.endswith("_total")}
    if d.get("decode_steps"):
        rec["server"] = {
            "decode_step_us": d["decode_step_seconds"] / d["decode_steps"] * 1e6,
            "decode_batch": d["decode_step_requests"] / d["decode_steps"],
            # Output tokens per second while decoding (q_len 1: a token a request a step).
            "decode_tok_s": d["decode_step_requests"] / max(1e-12, d["decode_step_seconds"]),
            "engine_step_us": d["engine_step_seconds"] / max(1.0, d["engine_steps"]) * 1e6,
            "model_step_us": d["model_step_seconds"] / max(1.0, d["model_steps"]) * 1e6,
            "overhead_share": 1.0 - d["model_step_seconds"] / max(1e-12, d["engine_step_seconds"]),
            # Of that overhead: the engine thread's wait for the GIL after each
            # step's C++ part (the handler threads hold it meanwhile).
            "gil_wait_us": d.get("engine_gil_wait_seconds", 0.0) / max(1.0, d["engine_steps"]) * 1e6,
            # How the decode steps ran (--cuda-graphs): replayed or eager.
            "graph_replays": int(d.get("decode_graph_replays", 0)),
            "graph_eager_steps": int(d.get("decode_graph_eager_steps", 0))}
        graphed = d.get("decode_graph_replays", 0) + d.get("decode_graph_eager_steps", 0)
        if graphed and "decode_graph_host_seconds" in d:
            # The graphed decode steps' host clock split at their launch (Model.decode_graph_stats).
            rec["server"]["graph_host_us"] = d["decode_graph_host_seconds"] / graphed * 1e6
            rec["server"]["graph_wait_us"] = d["decode_graph_wait_seconds"] / graphed * 1e6
    return rec


def bare_step_us(model_bench, batch):
    """model_bench.py's graphed step (q_len 1) at the measured batch nearest
    `batch`, of its first shape: (batch, us) or None."""
    rows = [r for r in model_bench["shapes"][0]["results"] if r["q_len"] == 1]
    if not rows:
        return None
    r = min(rows, key=lambda r: abs(r["batch"] - batch))
    return r["batch"], r["graph_us"]


def write_svg(path, rec):
    """Per trace, rate and concurrency: TTFT and ITL p50 (ms) and output
    tokens/s, a bar per prefix-caching setting, each row on its own scale."""
    from benchlib import stacked_bars_svg
    colours = {"on": "#26a69a", "off": "#ef6c00", "as-is": "#42a5f5"}
    cells = rec["cells"]
    rows = []
    for trace in dict.fromkeys(c["trace"] for c in cells):
        for rate, conc in dict.fromkeys((c["rate_per_s"], c["concurrency"]) for c in cells if c["trace"] == trace):
            mine = [c for c in cells if c["trace"] == trace and (c["rate_per_s"], c["concurrency"]) == (rate, conc)]
            where = f"{trace} C {conc}" + (f" at {rate:g}/s" if rate > 0 else "")
            for label, get in (("TTFT p50, ms", lambda c: c["ttft_ms"]["p50"]),
                               ("ITL p50, ms", lambda c: c["itl_ms"]["p50"]),
                               ("output tok/s", lambda c: c["output_tok_s"])):
                bars = [(f"cache {c['prefix_caching']}", {c["prefix_caching"]: get(c) or 0.0}) for c in mine]
                rows.append((f"{where}: {label}", bars))
    title = f"moelink-serve under load on {rec['gpu'] or rec['machine']}: prefix caching on and off"
    subtitle = (f"{rec['requests']} requests a cell, context {rec['context']}, {rec['max_tokens']} output tokens; "
                f"{rec['date'][:10]}, commit {rec['git_commit']}")
    stacked_bars_svg(path, title, subtitle, rows, [(k, v) for k, v in colours.items()], unit="")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a model directory: the benchmark starts python -m moelink.serve on it")
    where.add_argument("--url", help="a running server's API base, http://HOST:PORT/v1")
    p.add_argument("--serve-args", default="", help="more arguments of moelink.serve (with --model)")
    p.add_argument("--cache", default="on,off", help="prefix caching of the servers started (with --model)")
    p.add_argument("--traces", default="shared-prefix,multi-turn")
    p.add_argument("--concurrency", default="1,16,64,128", help="requests in flight at most")
    p.add_argument("--rate", default="0",
                   help="Poisson arrivals per second, comma-separated: a cell each (0: closed loop)")
    p.add_argument("--requests", type=int, default=256, help="requests per cell")
    p.add_argument("--context", type=int, default=5000, help="prompt tokens at most (a shared-prefix prompt's)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (with --url)")
    p.add_argument("--model-bench", help="model_bench.py's JSON of the same model (adds vs_bare)")
    p.add_argument("--server-log", default=None, help="the started server's output (default: discarded)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--machine", default=os.environ.get("MOELINK_MACHINE", "nvidia-h200"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="-")
    p.add_argument("--svg", help="also draw the cells here (bars)")
    a = p.parse_args()
    if a.model:
        with open(os.path.join(a.model, "config.json")) as f:
            a.vocab = json.load(f)["vocab_size"]
    elif a.vocab is None:
        p.error("--url needs --vocab (the prompts' token ids must fit the model's vocabulary)")
    try:
        rates = [float(v) for v in a.rate.split(",") if v]
    except ValueError:
        rates = []
    if not rates or any(r < 0 for r in rates):
        p.error(f"--rate {a.rate!r}: comma-separated arrivals per second (numbers >= 0; 0: closed loop)")
    concurrencies = [int(v) for v in a.concurrency.split(",") if v]
    gpu = "nvlink" in a.serve_args or a.url is not None
    try:
        import torch  # noqa: F401 (the record names the GPU where there is one)
        gpu = gpu and torch.cuda.is_available()
    except ImportError:
        gpu = False
    rec = header("serve_bench", a.machine, gpu=gpu)
    rec.update(serve_args=a.serve_args, url=a.url, context=a.context, max_tokens=a.max_tokens,
               requests=a.requests, rates_per_s=rates, cells=[])
    bench = None
    if a.model_bench:
        with open(a.model_bench) as f:
            bench = json.load(f)
    caches = [c for c in a.cache.split(",") if c] if a.model else ["as-is"]
    for cache in caches:
        if cache not in ("on", "off", "as-is"):
            raise SystemExit(f"serve_bench: --cache: {cache!r} is not on or off")
        args = a.serve_args.split() + (["--no-prefix-caching"] if cache == "off" else [])
        if "--max-model-len" not in args:
            args += ["--max-model-len", str(a.context + a.max_tokens)]
        server = Server(a.url, a.model, args, a.server_log, a.start_timeout)
        try:
            for trace in [t for t in a.traces.split(",") if t]:
                for k, (rate, c) in enumerate((r, c) for r in rates for c in concurrencies):
                    # Prompts of its own per cell: a cell finds none of an earlier one's in the cache.
                    # Enough requests for C in flight: C prompts, or C sessions of 4 turns.
                    count = max(a.requests, c * (4 if trace == "multi-turn" else 1))
                    sessions = trace_requests(trace, count, a.context, a.vocab, a.max_tokens, a.seed + k)
                    cell = run_cell(server, sessions, c, a.max_tokens, rate, a.seed)
                    cell.update(trace=trace, prefix_caching=cache)
                    if bench and "server" in cell:
                        bare = bare_step_us(bench, cell["server"]["decode_batch"])
                        if bare:
                            cell["vs_bare"] = {"batch": bare[0], "bare_step_us": bare[1],
                                               "bare_tok_s": bare[0] / bare[1] * 1e6,
                                               "overhead": cell["server"]["decode_step_us"] / bare[1] - 1}
                    rec["cells"].append(cell)
                    s = cell.get("server", {})
                    print(f"serve_bench: {trace:13s} cache {cache:3s} C {c:4d}" +
                          (f" at {rate:g}/s" if rate > 0 else "") + f"  {cell['output_tok_s']:9.1f} tok/s  "
                          f"TTFT p50 {cell['ttft_ms']['p50'] or 0:8.1f} p99 {cell['ttft_ms']['p99'] or 0:8.1f} ms  "
                          f"ITL p50 {cell['itl_ms']['p50'] or 0:7.1f} p99 {cell['itl_ms']['p99'] or 0:7.1f} ms  "
                          f"cached {cell['cached_share']:.2f}  errors {cell['errors']}" +
                          (f"  decode step {s['decode_step_us']:.0f} us at {s['decode_batch']:.1f} "
                           f"({s['graph_replays']} replayed, {s['graph_eager_steps']} eager; "
                           f"host {s.get('graph_host_us', 0):.0f} + wait {s.get('graph_wait_us', 0):.0f} us), "
                           f"overhead {s['overhead_share']:.3f} (GIL wait {s.get('gil_wait_us', 0):.0f} us a round)"
                           if s else ""), file=sys.stderr, flush=True)
                    if a.json != "-":
                        write_json(rec, a.json)
        finally:
            if a.model:
                server.stop()
    write_json(rec, a.json)
    if a.svg:
        write_svg(a.svg, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
