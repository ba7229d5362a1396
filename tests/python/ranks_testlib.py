"""Runs a test scenario in several processes, one per rank (the cpu
backends' multi-rank tests)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

import pytest

import moelink


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, scenario, kwargs, q):
    try:
        bs = moelink.TcpBootstrap(rank, world_size, "127.0.0.1", port, 30.0)
        scenario(rank, world_size, bs, **kwargs)
        q.put((rank, "ok"))
    except BaseException:  # report everything, including assertion errors
        q.put((rank, traceback.format_exc()))


def run_ranks(world_size: int, scenario, timeout: float = 60.0, **kwargs):
    """Runs scenario(rank, world_size, bootstrap, **kwargs) in world_size
    spawned processes joined by a TcpBootstrap on a free loopback port;
    fails the test with every rank's traceback, a dead rank's exit code or
    the ranks that gave no result within timeout seconds (hung). scenario
    must be a module-level function (spawn pickles it by name)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, scenario, kwargs, q),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                r, status = q.get(timeout=0.5)
                results[r] = status
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    # Give the queue a moment: a traceback may still be in flight.
                    time.sleep(0.5)
                    while True:
                        try:
                            r, status = q.get_nowait()
                            results[r] = status
                        except queue.Empty:
                            break
                    for i in dead:
                        results.setdefault(
                            i, f"rank {i} died with exit code {procs[i].exitcode}")
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
        q.join_thread()
    missing = [r for r in range(world_size) if r not in results]
    failed = {r: s for r, s in results.items() if s != "ok"}
    if missing or failed:
        msg = [f"scenario {scenario.__name__!r} on {world_size} ranks:"]
        msg += [f"rank {r}: no result within {timeout:.0f} s (hung?)" for r in missing]
        msg += [f"--- rank {r} ---\n{s}" for r, s in sorted(failed.items())]
        pytest.fail("\n".join(msg))
