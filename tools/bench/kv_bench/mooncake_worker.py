#!/usr/bin/env python3
"""Mooncake Transfer Engine (PyPI ``mooncake-transfer-engine[-non-cuda]``)
prefill and decode roles for kv_bench.

Each side: ``TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp",
"")`` (no metadata server: peers handshake directly; the session name is
``127.0.0.1:<rpc port>``) and ``register_memory`` of its whole pool. A
request is one batch of per-page writes (src address, dst address, length),
layer-major, the last page's length partial when the request ends mid-page.

Two ways to tell decode (case engine_options["mooncake_notify"]):

- ``control`` (default; what SGLang does with ZMQ): prefill submits every
  request with ``batch_transfer_async_write`` back to back (the fastest write
  call of the Python API: asynchronous, one call per request), waits for
  each with ``get_batch_transfer_status([id])`` in issue order and sends a
  one-message notice per request on the control socket; decode's t_done is
  when it reads the notice. Writes in flight are kept within the per-peer
  TCP queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, which the driver raises
  to its maximum 65,535 as tcp deployments do; the default 1,024 rejects a
  16-request DeepSeek batch): a request that would overflow it first waits
  for the oldest ones.
- ``engine``: Mooncake's own notification: ``batch_transfer_sync(...,
  TransferOpcode.Write, TransferNotify(name, msg))`` per request, from one
  thread per request (the call is synchronous), decode polls
  ``get_notifies()``.

The transport actually installed is read from the engine's log at
initialization ("TcpTransport: listen on port ..."). This wheel has no
shared-memory transport: protocol "shm" initializes but installs TcpTransport
(it only switches the buffer allocator), and MC_USE_TENT=1 is ignored (no
TENT backend compiled in), so kv_bench runs Mooncake in the tcp class only.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common  # noqa: E402
import harness  # noqa: E402

HOST = "127.0.0.1"
DISTS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
         "mooncake-transfer-engine-cuda13")


def _version() -> Dict[str, Any]:
    from importlib import metadata
    for d in DISTS:
        try:
            return {"package": d, "version": metadata.version(d)}
        except metadata.PackageNotFoundError:
            continue
    return {"package": "?", "version": "?"}


def probe() -> Dict[str, Any]:
    from mooncake.engine import TransferEngine  # noqa: F401
    return {"ok": True, "version": _version()}


def _start_engine(pool: np.ndarray):
    from mooncake.engine import TransferEngine
    eng = TransferEngine()
    with common.captured_fds((2,)) as log:
        rc = eng.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake: initialize(127.0.0.1, P2PHANDSHAKE, tcp) returned {rc}: {''.join(log)[-500:]}")
    rc = eng.register_memory(pool.ctypes.data, pool.nbytes)
    if rc != 0:
        raise RuntimeError(f"mooncake: register_memory of {pool.nbytes} B returned {rc}")
    found = sorted(set(re.findall(r"(\w+Transport): listen", "".join(log))))
    return eng, ", ".join(found) or "unknown"


def _mode(ctx: harness.Context) -> str:
    mode = str(ctx.opt("mooncake_notify", "control"))
    if mode not in ("control", "engine"):
        raise ValueError(f"mooncake: engine option mooncake_notify must be control or engine, not {mode!r}")
    return mode


class MooncakePrefill(harness.PrefillAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        self.ctx, self.case, self.pool = ctx, ctx.case, pool
        self.mode = _mode(ctx)
        self.eng, self.transport = _start_engine(pool)
        self.pool_threads = None
        self.inflight: List[tuple] = []  # (batch id, iteration, request, writes), issue order
        self.queued = 0
        self.max_inflight = int(ctx.opt("mooncake_max_inflight",
                                        os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", 1024)))

    def connect(self, peer: Dict[str, Any]) -> None:
        c = self.case
        self.target = peer["session"]
        pb = c.page_bytes
        self.src_layer = (self.pool.ctypes.data
                          + np.arange(c.layers, dtype=np.int64)[:, None] * (c.src_pool_pages * pb))
        self.dst_layer = (peer["base"]
                          + np.arange(c.layers, dtype=np.int64)[:, None] * (c.dst_pool_pages * pb))
        self.lengths = np.tile(c.page_lengths(), c.layers).tolist()
        if self.mode == "engine":
            self.pool_threads = concurrent.futures.ThreadPoolExecutor(max_workers=c.concurrency)

    def issue(self, it: int, i: int, src: np.ndarray, dst: np.ndarray) -> Any:
        pb = self.case.page_bytes
        srcs = (self.src_layer + src[None, :] * pb).ravel().tolist()
        dsts = (self.dst_layer + dst[None, :] * pb).ravel().tolist()
        if self.mode == "control":
            # Keep the writes in flight within the per-peer queue: wait for
            # (and announce) the oldest requests first if this one would overflow it.
            while self.inflight and self.queued + len(srcs) > self.max_inflight:
                self._finish(*self.inflight.pop(0))
            bid = self.eng.batch_transfer_async_write(self.target, srcs, dsts, self.lengths)
            if not bid or bid < 0:
                raise RuntimeError(f"mooncake: batch_transfer_async_write of request {i} returned {bid}")
            self.inflight.append((bid, it, i, len(srcs)))
            self.queued += len(srcs)
            return bid
        from mooncake.engine import TransferNotify, TransferOpcode
        note = TransferNotify("kv_bench", f"{it}:{i}")
        return self.pool_threads.submit(self.eng.batch_transfer_sync, self.target, srcs, dsts,
                                        self.lengths, TransferOpcode.Write, note)

    def _finish(self, bid: int, it: int, i: int, n: int) -> None:
        rc = self.eng.get_batch_transfer_status([bid])
        if rc != 0:
            raise RuntimeError(f"mooncake: request {i} (iteration {it}) failed: status {rc}")
        self.queued -= n
        self.ctx.channel.send({"done": (it, i)})

    def wait(self, handle: Any, it: int, i: int) -> None:
        if self.mode == "control":
            while self.inflight and self.inflight[0][1:3] <= (it, i):
                self._finish(*self.inflight.pop(0))
            return
        rc = handle.result(timeout=self.ctx.timeout_s)
        if rc != 0:
            raise RuntimeError(f"mooncake: batch_transfer_sync of request {i} (iteration {it}) returned {rc}")

    def info(self) -> Dict[str, Any]:
        api = ("batch_transfer_async_write + get_batch_transfer_status, notice on the control socket"
               if self.mode == "control" else
               "batch_transfer_sync(Write, TransferNotify) from one thread per request")
        return {"version": _version(), "transport_used": self.transport, "protocol": "tcp",
                "notify": self.mode, "api": api, "max_inflight_writes": self.max_inflight,
                "tcp_env": {k: v for k, v in os.environ.items() if k.startswith("MC_")}}

    def close(self) -> None:
        if self.pool_threads:
            self.pool_threads.shutdown()
        self.eng.unregister_memory(self.pool.ctypes.data)


class MooncakeDecode(harness.DecodeAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        self.ctx, self.case, self.pool = ctx, ctx.case, pool
        self.mode = _mode(ctx)
        self.eng, self.transport = _start_engine(pool)

    def metadata(self) -> Dict[str, Any]:
        return {"session": f"{HOST}:{self.eng.get_rpc_port()}", "base": self.pool.ctypes.data}

    def wait_all(self, it: int, dst: np.ndarray) -> List[int]:
        n = dst.shape[0]
        t_done: List[int] = [0] * n
        left = n
        if self.mode == "control":
            while left:
                msg = self.ctx.channel.recv()
                t = common.now_ns()
                mit, mi = msg["done"]
                if mit != it:
                    raise RuntimeError(f"mooncake: notice {msg!r} during iteration {it}")
                t_done[mi] = t
                left -= 1
            return t_done
        deadline = common.now_ns() + int(self.ctx.timeout_s * 1e9)
        while left:
            notes = self.eng.get_notifies()
            if notes:
                t = common.now_ns()
                for note in notes:
                    mit, _, mi = note.msg.partition(":")
                    if int(mit) != it:
                        raise RuntimeError(f"mooncake: notification {note.msg!r} during iteration {it}")
                    t_done[int(mi)] = t
                    left -= 1
                continue
            if common.now_ns() > deadline:
                raise TimeoutError(f"mooncake: {left} of {n} requests not notified after {self.ctx.timeout_s:g} s")
            self.ctx.poll_sleep()
        return t_done

    def info(self) -> Dict[str, Any]:
        return {"version": _version(), "transport_used": self.transport, "notify": self.mode}

    def close(self) -> None:
        self.eng.unregister_memory(self.pool.ctypes.data)


if __name__ == "__main__":
    harness.main("mooncake", {"prefill": MooncakePrefill, "decode": MooncakeDecode}, probe)
