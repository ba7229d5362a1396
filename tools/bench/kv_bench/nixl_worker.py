#!/usr/bin/env python3
"""NIXL (PyPI ``nixl``, UCX backend) prefill and decode roles for kv_bench.

Described the way vLLM's NixlConnector describes a paged cache: each side
registers one region per layer and prepares one descriptor per (layer, page)
of its pool; a request is one ``make_prepped_xfer("WRITE", ...)`` from
prefill's (layer, source page) descriptors to decode's (layer, destination
page) descriptors, with a notification message; decode learns of the request
from ``get_new_notifs()`` (NIXL sends the notification after the writes).
When requests end mid-page, both lists get a second set of descriptors of
the partial length, used for the last page.

The transport comes from the environment (the driver sets it): UCX_TLS
(``sm,self`` or ``tcp,self``), UCX_NET_DEVICES=lo for tcp. UCX's
shared-memory transports have no peer-failure handling, so with them the
backend needs ``ucx_error_handling_mode=none`` (NIXL's default ``peer`` makes
endpoint creation fail: "no peer failure handler"); with tcp NIXL's default
is kept (case engine_options["ucx_error_handling_mode"] overrides). The
transport UCX actually picked is read from its UCX_PROTO_INFO table.

Usage: see harness.py (``--role prefill|decode --case JSON --control
host:port --out result.json``; ``--probe``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("UCX_PROTO_INFO", "y")  # protocol tables: the transport actually used

import numpy as np  # noqa: E402

import common  # noqa: E402
import harness  # noqa: E402


def _version() -> Dict[str, Any]:
    from importlib import metadata
    import nixl
    backend = sys.modules[nixl._api.__name__].__package__ if hasattr(nixl, "_api") else "?"
    out = {"nixl": metadata.version("nixl"), "nixl_module": backend}
    libs = os.path.join(os.path.dirname(sys.modules[backend].__file__), os.pardir, backend + ".libs")
    if os.path.isdir(libs):
        out["ucx_libs"] = sorted(f for f in os.listdir(libs) if f.startswith("libuc"))
    return out


def probe() -> Dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("kv_bench_probe", nixl_agent_config(backends=[]))
    plugins = agent.get_plugin_list()
    if "UCX" not in plugins:
        return {"ok": False, "error": f"NIXL has no UCX plugin (plugins: {plugins})"}
    return {"ok": True, "version": _version(), "plugins": plugins}


def _error_mode(ctx: harness.Context) -> str:
    default = "none" if ctx.case.transport == "shm" else ""
    return str(ctx.opt("ucx_error_handling_mode", default))


def _make_agent(name: str, ctx: harness.Context):
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    params = {}
    mode = _error_mode(ctx)
    if mode:
        params["ucx_error_handling_mode"] = mode
    agent.create_backend("UCX", params)
    return agent


def _page_descs(base: int, layers: int, pages: int, page_bytes: int, lengths: List[int]) -> np.ndarray:
    """Nx3 (addr, len, dev 0) rows: for each length, every (layer, page), layer-major."""
    rows = []
    addr = base + np.arange(layers * pages, dtype=np.uint64) * np.uint64(page_bytes)
    for n in lengths:
        d = np.zeros((layers * pages, 3), dtype=np.uint64)
        d[:, 0] = addr
        d[:, 1] = n
        rows.append(d)
    return np.concatenate(rows)


def _lengths(case: common.Case) -> List[int]:
    return [case.page_bytes] if case.last_page_bytes == case.page_bytes else [case.page_bytes,
                                                                            case.last_page_bytes]


def _register(agent, pool: np.ndarray):
    """One region per layer, as vLLM registers one cache tensor per layer."""
    layers = pool.shape[0]
    stride = pool.shape[1] * pool.shape[2]
    base = pool.ctypes.data
    regs = [(base + l * stride, stride, 0, "") for l in range(layers)]
    return agent.register_memory(regs, "DRAM")


def _transport_from_proto_info(text: str) -> str:
    """The 'remote memory write by ucp_put*' row of the prefill->decode
    endpoint's UCX_PROTO_INFO table, e.g. '0..inf zero-copy cma/memory'."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if re.search(r"(intra|inter)-node cfg", line) and "self cfg" not in line:
            for j in range(k, min(k + 12, len(lines))):
                if "ucp_put* from host memory" in lines[j]:
                    cfg = []
                    for row in lines[j + 1: j + 10]:
                        cells = [c.strip() for c in row.split("|")[1:-1]]
                        if len(cells) == 3 and cells[0] and cells[0][0].isdigit():
                            cfg.append(" ".join(cells))
                    if cfg:
                        return "put: " + "; ".join(cfg)
    return "unknown (no UCX_PROTO_INFO table for the peer endpoint)"


class NixlPrefill(harness.PrefillAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        self.ctx, self.case, self.pool = ctx, ctx.case, pool
        self.agent = _make_agent("prefill", ctx)
        self.reg = _register(self.agent, pool)
        self.transport = "unknown"

    def connect(self, peer: Dict[str, Any]) -> None:
        c = self.case
        # UCX prints its protocol choice (UCX_PROTO_INFO) when the endpoint
        # is created or first used: capture from here to the first transfer.
        self._capture = contextlib.ExitStack()
        self.proto_text = self._capture.enter_context(common.captured_fds())
        self.peer = self.agent.add_remote_agent(peer["agent_md"])
        lengths = _lengths(c)
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _page_descs(self.pool.ctypes.data, c.layers, c.src_pool_pages,
                                           c.page_bytes, lengths), "DRAM")
        self.remote = self.agent.prep_xfer_dlist(
            self.peer, _page_descs(peer["base"], c.layers, c.dst_pool_pages, c.page_bytes, lengths),
            "DRAM")
        # Descriptor index of (layer l, page p) = l * pool_pages + p, plus the
        # partial set's offset for the last page.
        self.src_layer = (np.arange(c.layers, dtype=np.int64) * c.src_pool_pages)[:, None]
        self.dst_layer = (np.arange(c.layers, dtype=np.int64) * c.dst_pool_pages)[:, None]
        self.partial = len(lengths) > 1
        self.first = True

    def issue(self, it: int, i: int, src: np.ndarray, dst: np.ndarray) -> Any:
        c = self.case
        lidx = self.src_layer + src[None, :]
        ridx = self.dst_layer + dst[None, :]
        if self.partial:
            lidx[:, -1] += c.layers * c.src_pool_pages
            ridx[:, -1] += c.layers * c.dst_pool_pages
        if not self.first:
            return self._post(lidx, ridx, it, i)
        self.first = False  # the first transfer (a warm-up one) ends the capture of UCX's tables
        try:
            h = self._post(lidx, ridx, it, i)
            self.wait(h, it, i)
        finally:
            self._capture.close()
        self.transport = _transport_from_proto_info("".join(self.proto_text))
        return h

    def _post(self, lidx: np.ndarray, ridx: np.ndarray, it: int, i: int):
        h = self.agent.make_prepped_xfer("WRITE", self.local, lidx.ravel().astype(np.int32), self.remote,
                                         ridx.ravel().astype(np.int32), f"{it}:{i}".encode())
        state = self.agent.transfer(h)
        if state == "ERR":
            raise RuntimeError(f"nixl: transfer of request {i} (iteration {it}) failed to post")
        return h

    def wait(self, handle: Any, it: int, i: int) -> None:
        while True:
            state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state == "ERR":
                raise RuntimeError(f"nixl: transfer of request {i} (iteration {it}) failed")
            self.ctx.poll_sleep()

    def release(self, handles: List[Any]) -> None:
        for h in handles:
            self.agent.release_xfer_handle(h)

    def info(self) -> Dict[str, Any]:
        return {"version": _version(), "transport_used": self.transport,
                "ucx_tls": os.environ.get("UCX_TLS", ""),
                "ucx_error_handling_mode": _error_mode(self.ctx) or "NIXL default (peer)",
                "progress_thread": "NIXL default (enable_prog_thread=True, as vLLM creates its agent)",
                "api": "prep_xfer_dlist per (layer, page) + make_prepped_xfer WRITE + notif"}

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.release_dlist_handle(self.remote)
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


class NixlDecode(harness.DecodeAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        self.ctx, self.case, self.pool = ctx, ctx.case, pool
        self.agent = _make_agent("decode", ctx)
        self.reg = _register(self.agent, pool)

    def metadata(self) -> Dict[str, Any]:
        return {"agent_md": self.agent.get_agent_metadata(), "base": self.pool.ctypes.data}

    def wait_all(self, it: int, dst: np.ndarray) -> List[int]:
        n = dst.shape[0]
        t_done: List[int] = [0] * n
        left = n
        deadline = common.now_ns() + int(self.ctx.timeout_s * 1e9)
        while left:
            notifs = self.agent.get_new_notifs()
            if notifs:
                t = common.now_ns()
                for msgs in notifs.values():
                    for m in msgs:
                        mit, _, mi = m.decode().partition(":")
                        if int(mit) != it:
                            raise RuntimeError(f"nixl: notification {m!r} during iteration {it}")
                        t_done[int(mi)] = t
                        left -= 1
                continue
            if common.now_ns() > deadline:
                raise TimeoutError(f"nixl: {left} of {n} requests not notified after {self.ctx.timeout_s:g} s")
            self.ctx.poll_sleep()
        return t_done

    def info(self) -> Dict[str, Any]:
        return {"version": _version(), "ucx_tls": os.environ.get("UCX_TLS", ""),
                "notification": "get_new_notifs (NIXL notif after the WRITE)"}

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


if __name__ == "__main__":
    harness.main("nixl", {"prefill": NixlPrefill, "decode": NixlDecode}, probe)
