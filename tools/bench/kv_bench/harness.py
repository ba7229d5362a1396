"""The prefill and decode roles, identical for every engine; an engine's
worker supplies only an adapter (how to register, describe, write, wait).

Protocol on the control channel (common.Channel; decode listens):

  setup      decode -> {"meta": engine metadata}
             prefill -> {"meta": engine metadata, "sums": source page checksums}
             both adapters connect (concurrently: moelink's warm-up barrier
             needs both sides in it)
  iteration  decode -> {"iter": it, "dst": (concurrency, pages) page ids}
                 (decode is waiting when prefill reads this: the start barrier)
             prefill: t_issue[i] just before request i's engine calls and
                 t_posted[i] when they returned, all requests issued back to
                 back, then waits for local completion
             decode: t_done[i] when the engine says request i's pages arrived
             prefill -> {"iter_done": it, "src": ids, "t_issue": [...], "t_posted": [...]}
             decode verifies every page (untimed), zeroes, checks the rest
  end        decode -> {"bye": True}

Timed: latency per request = t_done - t_issue (one monotonic clock: same
host); latency from the batch's start = t_done - min(t_issue), what a
request waits when all were ready at once (an engine whose issue call
itself moves the bytes delays the next request's t_issue: its per-request
latency then hides the queueing); issue time = t_posted - t_issue;
iteration throughput = bytes / (max t_done - min t_issue); CPU
seconds = getrusage deltas over the timed windows (prefill: issue ->
all local completions; decode: sending the page ids -> all requests seen).

Worker command line (each engine's worker calls main()):

  python3 <engine>_worker.py --role prefill|decode --case JSON|@file \\
      --control 127.0.0.1:PORT --out result.json [--timeout S] [--poll-us N]
      [--corrupt-for-test]
  python3 <engine>_worker.py --probe       # prints {"ok", "version"|"error"}

Exit status: 0 ok, 1 error, 3 verification failure (the message names the
engine, layer and page). The process leaves through os._exit after writing
its result, so an engine's teardown crash cannot turn a good cell bad.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import common
from common import Case, Channel

EXIT_ERROR = 1
EXIT_VERIFY = 3


@dataclasses.dataclass
class Context:
    """What an adapter may use besides its pool."""

    role: str
    case: Case
    timeout_s: float
    poll_s: float                       # sleep between polls of a completion
    channel: Optional[Channel] = None   # set before connect()

    def opt(self, key: str, default: Any) -> Any:
        return self.case.engine_options.get(key, default)

    def poll_sleep(self) -> None:
        if self.poll_s > 0:
            time.sleep(self.poll_s)


class PrefillAdapter:
    """Engine side of the prefill role (the source pool is registered in __init__)."""

    def metadata(self) -> Dict[str, Any]:
        return {}

    def connect(self, peer: Dict[str, Any]) -> None:
        raise NotImplementedError

    def issue(self, it: int, i: int, src: np.ndarray, dst: np.ndarray) -> Any:
        """Starts request i's writes (src/dst: page ids, one per request page)."""
        raise NotImplementedError

    def wait(self, handle: Any, it: int, i: int) -> None:
        """Returns when request i's writes completed locally."""
        raise NotImplementedError

    def release(self, handles: List[Any]) -> None:
        pass

    def info(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class DecodeAdapter:
    """Engine side of the decode role (the destination pool is registered in __init__)."""

    def metadata(self) -> Dict[str, Any]:
        return {}

    def connect(self, peer: Dict[str, Any]) -> None:
        pass

    def wait_all(self, it: int, dst: np.ndarray) -> List[int]:
        """Returns t_done (common.now_ns) per request: when the engine's own
        notification says all of request i's pages are in place."""
        raise NotImplementedError

    def info(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


Factory = Callable[[Context, np.ndarray], Any]


# ------------------------------------------------------------------ roles

def run_prefill(ctx: Context, make: Factory, control: str) -> Dict[str, Any]:
    case = ctx.case
    t0 = time.monotonic()
    pool = common.alloc_pool(case.layers, case.src_pool_pages, case.page_bytes)
    common.fill_source_pool(pool, case.seed)
    sums = common.source_checksums(pool, case)
    eng = make(ctx, pool)
    ctx.channel = ch = Channel.connect(*common.parse_hostport(control), ctx.timeout_s)
    peer = ch.recv()["meta"]
    ch.send({"meta": eng.metadata(), "sums": sums})
    eng.connect(peer)
    setup_s = time.monotonic() - t0

    rng = np.random.default_rng([case.seed, 2])
    cpu_s, local_ns = 0.0, []
    for it in range(case.warmup + case.iters):
        msg = ch.recv()
        assert msg.get("iter") == it, f"prefill: expected iteration {it}, got {msg!r:.80}"
        dst = msg["dst"]
        src = common.pick_src_pages(rng, case)
        c0 = common.cpu_seconds()
        t_issue, t_posted, handles = [], [], []
        for i in range(case.concurrency):
            t_issue.append(common.now_ns())
            handles.append(eng.issue(it, i, src[i], dst[i]))
            t_posted.append(common.now_ns())
        for i, h in enumerate(handles):
            eng.wait(h, it, i)
        t_local = common.now_ns()
        c1 = common.cpu_seconds()
        eng.release(handles)
        if it >= case.warmup:
            cpu_s += c1 - c0
            local_ns.append(t_local - min(t_issue))
        ch.send({"iter_done": it, "src": src, "t_issue": t_issue, "t_posted": t_posted})
    msg = ch.recv()
    assert msg.get("bye"), f"prefill: expected bye, got {msg!r:.80}"
    return {"setup_s": setup_s, "cpu_s": cpu_s, "local_completion_ns": local_ns,
            "engine": eng.info(), "_adapter": eng}


def run_decode(ctx: Context, make: Factory, control: str, engine_name: str,
               corrupt: bool) -> Dict[str, Any]:
    case = ctx.case
    t0 = time.monotonic()
    pool = common.alloc_pool(case.layers, case.dst_pool_pages, case.page_bytes)
    eng = make(ctx, pool)
    ctx.channel = ch = Channel.listen(*common.parse_hostport(control), ctx.timeout_s)
    ch.send({"meta": eng.metadata()})
    msg = ch.recv()
    peer, sums = msg["meta"], msg["sums"]
    eng.connect(peer)
    setup_s = time.monotonic() - t0

    rng = np.random.default_rng([case.seed, 1])
    lat, lat_start, issue, gbps, spans, cpu_s, verified = [], [], [], [], [], 0.0, 0
    result: Dict[str, Any] = {"_adapter": eng}
    for it in range(case.warmup + case.iters):
        dst = common.alloc_dst_pages(rng, case)
        c0 = common.cpu_seconds()
        ch.send({"iter": it, "dst": dst})
        t_done = eng.wait_all(it, dst)
        c1 = common.cpu_seconds()
        msg = ch.recv()
        assert msg.get("iter_done") == it, f"decode: expected iteration {it} done, got {msg!r:.80}"
        t_issue = msg["t_issue"]
        if it >= case.warmup:
            cpu_s += c1 - c0
            lat.extend(int(d - s) for s, d in zip(t_issue, t_done))
            lat_start.extend(int(d - min(t_issue)) for d in t_done)
            issue.extend(int(p - s) for s, p in zip(t_issue, msg["t_posted"]))
            span = max(t_done) - min(t_issue)
            spans.append(int(span))
            gbps.append(case.iteration_bytes / span)  # bytes per ns == GB/s
        if corrupt and it == 0:
            layer, page = case.layers // 2, int(dst[0, case.request_pages // 2])
            pool[layer, page, 0] ^= 0xFF
        verified += common.verify_and_clear(engine_name, pool, case, dst, msg["src"], sums)
    ch.send({"bye": True})
    result.update({"setup_s": setup_s, "cpu_s": cpu_s, "latency_ns": lat,
                   "latency_from_start_ns": lat_start, "issue_ns": issue, "iteration_gbps": gbps,
                   "iteration_span_ns": spans, "verified_pages": verified,
                   "engine": eng.info()})
    return result


# ------------------------------------------------------------------ CLI

def _load_case(text: str) -> Case:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    return Case.from_json(text)


def _write(path: Optional[str], obj: Dict[str, Any]) -> None:
    text = json.dumps(obj, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    else:
        print(text)


def main(engine_name: str, factories: Dict[str, Factory], probe: Callable[[], Dict[str, Any]]) -> None:
    """Entry point of an engine's worker; never returns (os._exit)."""
    ap = argparse.ArgumentParser(description=f"kv_bench {engine_name} worker (prefill or decode role)")
    ap.add_argument("--role", choices=("prefill", "decode"))
    ap.add_argument("--case", help="case JSON, or @path of a file holding it")
    ap.add_argument("--control", default="127.0.0.1:0", help="decode's control address host:port")
    ap.add_argument("--out", help="result JSON path (stdout if absent)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the peer or the engine")
    ap.add_argument("--poll-us", type=float, default=20.0,
                    help="sleep between polls of a completion/notification (0: spin)")
    ap.add_argument("--corrupt-for-test", action="store_true",
                    help="decode flips a byte of one received page before verifying (must fail)")
    ap.add_argument("--probe", action="store_true", help="import the engine, print its version, exit")
    args = ap.parse_args()

    if args.probe:
        try:
            res = probe()
        except BaseException as e:  # noqa: BLE001 - report any import failure
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res))
        sys.stdout.flush()
        os._exit(0 if res.get("ok") else EXIT_ERROR)

    if not args.role or not args.case:
        ap.error("--role and --case are required")
    case = _load_case(args.case)
    ctx = Context(role=args.role, case=case, timeout_s=args.timeout, poll_s=args.poll_us * 1e-6)
    base = {"engine": engine_name, "role": args.role, "case": dataclasses.asdict(case),
            "pid": os.getpid()}
    code = 0
    adapter = None
    t0 = time.monotonic()
    try:
        if args.role == "prefill":
            res = run_prefill(ctx, factories["prefill"], args.control)
        else:
            res = run_decode(ctx, factories["decode"], args.control, engine_name, args.corrupt_for_test)
        adapter = res.pop("_adapter", None)
        base.update(res)
        base["ok"] = True
    except common.VerificationError as e:
        base.update(ok=False, error=str(e))
        code = EXIT_VERIFY
    except BaseException as e:  # noqa: BLE001 - the cell fails, the message says why
        base.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        code = EXIT_ERROR
    base["wall_s"] = time.monotonic() - t0
    _write(args.out, base)
    if not base["ok"]:
        print(f"kv_bench {engine_name} {args.role}: {base['error']}", file=sys.stderr)
    if ctx.channel is not None:
        ctx.channel.close()
    if adapter is not None:
        try:
            adapter.close()
        except BaseException as e:  # noqa: BLE001
            print(f"kv_bench {engine_name} {args.role}: close: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
