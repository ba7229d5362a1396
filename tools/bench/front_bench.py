#!/usr/bin/env python3
"""moelink-serve's front alone: the HTTP server, its handler threads and its
engine thread, over a stub engine whose step sleeps like a GPU step (the
GIL released), on any machine (no GPU, no model).

    python3 tools/bench/front_bench.py [--requests 128] [--max-tokens 128]
        [--step-ms 7] [--switch-us 500,5000] [--rounds 2] [--json front.json]

Per GIL switch interval (MOELINK_SERVE_SWITCH_INTERVAL_US, --switch-us) and
round, a server process starts, a client process streams --requests
completions of --max-tokens tokens at once (asyncio, one connection each),
and the stub engine records when each of its steps ran. Over the steps that
carried every request:
  front_share   1 - (time in the stub's steps) / (their span): the engine
                thread's rounds outside its model step (the server's own
                work and its waits for the GIL), as a share of the decode
                phase (issue 35's server overhead, without the GPU);
  gap_us        p50 / p90 of the time between one step's end and the next
                one's start;
  gil_wait_us   p50 / p90 of the engine thread's wait for the GIL after a
                step (past the stub's sleep: its overshoot, tens of us,
                included), which gap_us holds.
The rounds of different settings interleave; the summary is their medians.
The stub's step is the GPU's bare step: 7 ms is the DeepSeek-V3-shaped
model's step at 128 requests (bench/results).
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from benchlib import free_port, header, write_json


def stub_server(model_dir, port, step_ms, max_tokens, switch_us, ready, rounds_out, stop):
    """The server process: moelink.serve.server's Server over a stub engine."""
    os.environ["MOELINK_SERVE_SWITCH_INTERVAL_US"] = str(switch_us)  # what set_switch_interval reads
    import moelink.serve.server as S
    from moelink._engine import StepResult

    class StubEngine:
        """What Server's engine thread calls of moelink.Engine: every
        request gets a token a step until its max_tokens."""

        def __init__(self):
            self.requests, self.next_id, self.steps = {}, 0, []
            self.times = dict(steps=0, seconds=0.0, decode_steps=0, decode_seconds=0.0, decode_requests=0,
                              step_seconds=0.0, gil_wait_seconds=0.0)

        def add(self, prompt, max_tokens=16, **_):
            self.next_id += 1
            self.requests[self.next_id] = [max_tokens, 0, False]
            return self.next_id

        def cancel(self, rid):
            if rid in self.requests:
                self.requests[rid][2] = True

        running = property(lambda s: len(s.requests))
        waiting = property(lambda s: 0)
        available_pages = property(lambda s: 1 << 20)
        idle = property(lambda s: not s.requests)
        step_times = property(lambda s: dict(s.times))
        drafts_proposed = drafts_accepted = 0
        failure = ""

        def step(self):
            t0 = time.perf_counter()
            time.sleep(step_ms * 1e-3)  # the model's step: the GIL released, as in Engine.step
            t1 = time.perf_counter()
            # The step is the sleep; what t1 has past its end is the wait to
            # take the GIL back (and the sleep's own overshoot, tens of us),
            # which the real engine's clocks count outside the model's step.
            end = t0 + step_ms * 1e-3
            out = []
            for rid, r in list(self.requests.items()):
                if r[2]:
                    out.append(StepResult(rid, [], "cancelled", 0))
                    del self.requests[rid]
                    continue
                r[1] += 1
                finished = "length" if r[1] >= r[0] else ""
                out.append(StepResult(rid, [100 + (rid * 7 + r[1]) % 1000], finished, 0))
                if finished:
                    del self.requests[rid]
            for k, v in (("steps", 1), ("seconds", end - t0), ("decode_steps", 1),
                         ("decode_seconds", end - t0), ("decode_requests", len(out)),
                         ("step_seconds", end - t0), ("gil_wait_seconds", max(0.0, t1 - end))):
                self.times[k] += v
            self.steps.append((t0, end, len(out), max(0.0, t1 - end)))
            return out

    stub = StubEngine()
    S.load_engine = lambda d, o: stub
    S.set_switch_interval()
    server = S.Server(model_dir, S.ServerOptions(max_running=1 << 16, num_pages=1 << 20,
                                                  max_model_len=max_tokens + 64))
    server.start("127.0.0.1", port)
    ready.set()
    stop.wait()
    rounds_out.put(stub.steps)
    server.stop()


async def stream_one(port, max_tokens):
    """One streamed completion; returns its chunks."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "m", "prompt": "w1 w2 w3", "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    chunks = 0
    while True:
        line = await reader.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        chunks += line.startswith(b"data: ")
    writer.close()
    return chunks


def one_round(model_dir, a, switch_us):
    ctx = mp.get_context("spawn")
    ready, stop, steps_q = ctx.Event(), ctx.Event(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=stub_server,
                       args=(model_dir, port, a.step_ms, a.max_tokens, switch_us, ready, steps_q, stop))
    proc.start()
    try:
        if not ready.wait(120):
            raise SystemExit("front_bench: the server did not start within 120 s")

        async def run():
            return await asyncio.gather(*(stream_one(port, a.max_tokens) for _ in range(a.requests)))

        t0 = time.perf_counter()
        chunks = asyncio.run(run())
        wall = time.perf_counter() - t0
        stop.set()
        steps = steps_q.get(timeout=60)
    finally:
        stop.set()
        proc.join(30)
    full = [(s, e, w) for s, e, n, w in steps if n == a.requests]
    if len(full) < 3 or sum(chunks) < a.requests * a.max_tokens:
        raise SystemExit(f"front_bench: {sum(chunks)} of {a.requests * a.max_tokens} chunks streamed, "
                         f"{len(full)} steps carried every request")
    gaps = sorted(full[i + 1][0] - full[i][1] for i in range(len(full) - 1))
    waits = sorted(w for _, _, w in full)
    span = full[-1][1] - full[0][0]
    return {"switch_us": switch_us, "front_share": 1 - sum(e - s for s, e, _ in full) / span,
            "gap_us_p50": gaps[len(gaps) // 2] * 1e6, "gap_us_p90": gaps[int(len(gaps) * 0.9)] * 1e6,
            "gil_wait_us_p50": waits[len(waits) // 2] * 1e6, "gil_wait_us_p90": waits[int(len(waits) * 0.9)] * 1e6,
            "full_steps": len(full), "client_wall_s": wall, "tok_s": sum(chunks) / wall}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128, help="streamed requests at once (>= 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each (>= 4)")
    p.add_argument("--step-ms", type=float, default=7.0, help="the stub engine's step (0.1 to 1000 ms)")
    p.add_argument("--switch-us", default="500,5000", help="GIL switch intervals to compare (10 to 5000 us)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setting (>= 1)")
    p.add_argument("--machine", default="cpu")
    p.add_argument("--json", default="-", help="output file ('-': standard output)")
    a = p.parse_args()
    switches = [int(s) for s in a.switch_us.split(",") if s]
    for name, v, lo, hi in (("--requests", a.requests, 1, 4096), ("--max-tokens", a.max_tokens, 4, 1 << 16),
                            ("--step-ms", a.step_ms, 0.1, 1000), ("--rounds", a.rounds, 1, 100)):
        if not lo <= v <= hi:
            p.error(f"{name} = {v} must be from {lo} to {hi}")
    if not switches or any(not 10 <= s <= 5000 for s in switches):
        p.error(f"--switch-us = '{a.switch_us}' must name intervals from 10 to 5000 us")
    # A model directory with the tokenizer and config the front reads; the
    # served model's name is the directory's ("m").
    from moelink.serve.tiny_model import write_tokenizer
    model_dir = os.path.join(tempfile.mkdtemp(prefix="moelink-front-bench-"), "m")
    os.makedirs(model_dir)
    write_tokenizer(model_dir, 129280)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"vocab_size": 129280, "eos_token_id": 1}, f)

    rec = header("front_bench", a.machine, gpu=False)
    rec.update(requests=a.requests, max_tokens=a.max_tokens, step_ms=a.step_ms, cpus=os.cpu_count(), rounds=[])
    for r in range(a.rounds):
        for s in switches:
            row = one_round(model_dir, a, s)
            row["round"] = r + 1
            rec["rounds"].append(row)
            print(f"front_bench: round {r + 1} switch {s:5d} us  front share {row['front_share']:.3f}  "
                  f"gap p50 {row['gap_us_p50']:8.0f} us  p90 {row['gap_us_p90']:8.0f} us  "
                  f"GIL wait p50 {row['gil_wait_us_p50']:6.0f} us  p90 {row['gil_wait_us_p90']:6.0f} us  "
                  f"{row['tok_s']:8.0f} tok/s", file=sys.stderr, flush=True)
    rec["summary"] = [{"switch_us": s, **{k: statistics.median(x[k] for x in rec["rounds"] if x["switch_us"] == s)
                                         for k in ("front_share", "gap_us_p50", "gap_us_p90", "gil_wait_us_p50",
                                                   "gil_wait_us_p90", "tok_s")}}
                      for s in switches]
    write_json(rec, a.json)


if __name__ == "__main__":
    main()
