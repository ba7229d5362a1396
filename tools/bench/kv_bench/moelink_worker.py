#!/usr/bin/env python3
"""moelink TransferEngine prefill and decode roles for kv_bench.

Uses moelink's Python binding of its TransferEngine and KV-cache transfer
(docs/transfer_engine.md, "KV-cache transfer"): each side registers its
whole pool (``register_memory`` of the numpy array) and sends its
``descriptor``; both add the peer to a group and pass a warm-up barrier
(tcp connects there, outside the timing). Both sides describe their pool as
``KvCacheLayout.layer_major`` (like vLLM). A request is one
``write_kv_cache`` (per-layer immediates, ``imm_base = 0x1000 + i *
layers``: requests in flight at once need disjoint immediates); decode knows
it arrived when ``wait_kv_cache`` returns (immediates are counted only after
their page's bytes are in place). Decode waits for the requests in issue
order (wait_kv_cache blocks; requests complete in order on one peer).

Provider from the transport class: ``shm`` -> libfabric ``shm``, ``tcp`` ->
``tcp`` (``tcp;ofi_rxm``; the driver sets FI_TCP_IFACE=lo). Workers idle
by sleeping (``busy_poll=False``; engine_options["busy_poll"] overrides).

The binding is looked up on sys.path, MOELINK_PYTHONPATH, then
``build/python`` of the repository.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
for _p in [os.path.join(ROOT, "build", "python")] + os.environ.get("MOELINK_PYTHONPATH", "").split(os.pathsep)[::-1]:
    if _p and os.path.isdir(_p):
        sys.path.insert(1, os.path.abspath(_p))

import numpy as np  # noqa: E402

import harness  # noqa: E402

IMM_BASE = 0x1000
WARM_IMM = 0xFFF0


def _import():
    import moelink
    if not hasattr(moelink, "TransferEngine"):
        raise ImportError(f"moelink at {os.path.dirname(moelink.__file__)} has no TransferEngine "
                          "(built without the KV-transfer binding?)")
    return moelink


def _version() -> Dict[str, Any]:
    moelink = _import()
    return {"moelink": getattr(moelink, "__version__", "?"), "path": os.path.dirname(moelink.__file__)}


def probe() -> Dict[str, Any]:
    _import()
    return {"ok": True, "version": _version()}


def _provider(ctx: harness.Context) -> str:
    return str(ctx.opt("provider", {"shm": "shm", "tcp": "tcp"}[ctx.case.transport]))


class _Side:
    """Engine, registration and layout shared by both roles."""

    def __init__(self, ctx: harness.Context, pool: np.ndarray, name: str, pool_pages: int) -> None:
        ml = _import()
        self.ml, self.ctx, self.case, self.pool = ml, ctx, ctx.case, pool
        self.eng = ml.TransferEngine(provider=_provider(ctx), name=name, timeout_s=ctx.timeout_s,
                                     busy_poll=bool(ctx.opt("busy_poll", False)))
        self.region = self.eng.register_memory(pool.reshape(-1))
        self.layout = self._layout(pool_pages)

    def _layout(self, pages: int):
        c = self.case
        return self.ml.KvCacheLayout.layer_major(c.layers, c.bytes_per_token_layer, c.tokens_per_page, pages)

    def metadata(self) -> Dict[str, Any]:
        return {"desc": bytes(self.eng.descriptor(self.region))}

    def connect(self, peer: Dict[str, Any]) -> None:
        self.peer = self.ml.MemoryDescriptor.from_bytes(peer["desc"])
        group = self.eng.add_peer_group([self.peer])
        self.eng.barrier(group, imm=WARM_IMM).wait()
        self.eng.wait_imm(WARM_IMM, 1)

    def request(self, i: int, src, dst):
        return self.ml.KvTransferRequest(self.case.tokens, [int(p) for p in src], [int(p) for p in dst],
                                         IMM_BASE + i * self.case.layers, imm_mode="layer")

    def info(self) -> Dict[str, Any]:
        used = getattr(self.eng, "provider", None)
        used = used() if callable(used) else used
        return {"version": _version(), "provider": _provider(self.ctx),
                "transport_used": f"libfabric {used}" if used else f"libfabric {_provider(self.ctx)} (requested)",
                "busy_poll": bool(self.ctx.opt("busy_poll", False)),
                "api": "write_kv_cache / wait_kv_cache, layer-major both sides, per-layer immediates"}

    def close(self) -> None:
        self.eng.deregister_memory(self.region)
        close = getattr(self.eng, "close", None)
        if close:
            close()


class MoelinkPrefill(_Side, harness.PrefillAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        super().__init__(ctx, pool, "prefill", ctx.case.src_pool_pages)
        self.dst_layout = self._layout(ctx.case.dst_pool_pages)

    def issue(self, it: int, i: int, src: np.ndarray, dst: np.ndarray) -> Any:
        req = self.request(i, src, dst)
        return self.eng.write_kv_cache(self.region, self.layout, self.peer, self.dst_layout, req)

    def wait(self, handle: Any, it: int, i: int) -> None:
        handle.wait(timeout_s=self.ctx.timeout_s)


class MoelinkDecode(_Side, harness.DecodeAdapter):
    def __init__(self, ctx: harness.Context, pool: np.ndarray) -> None:
        super().__init__(ctx, pool, "decode", ctx.case.dst_pool_pages)

    def wait_all(self, it: int, dst: np.ndarray) -> List[int]:
        import common
        t_done = []
        for i in range(dst.shape[0]):
            # Decode does not know prefill's source ids; wait_kv_cache counts
            # pages from the request's size and destination ids only.
            req = self.request(i, dst[i], dst[i])
            self.eng.wait_kv_cache(self.layout, req, self.peer.name, timeout_s=self.ctx.timeout_s)
            t_done.append(common.now_ns())
        return t_done


if __name__ == "__main__":
    harness.main("moelink", {"prefill": MoelinkPrefill, "decode": MoelinkDecode}, probe)
