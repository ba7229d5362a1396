"""Prefill/decode disaggregation's KV hand-off between two moelink.Engines.

A prefill engine runs a request with hand_off=True up to its first token
and holds its pages; the decode engine receive()s it (pages for the prompt,
prefix-cached ones shared); the prompt's KV rows of every layer (the MTP
module's too) move from the prefill model's cache into those pages through
the TransferEngine (paged writes, one immediate per layer); the decode
engine resume()s it after the first token and the prefill engine
release()s its pages.

    prefill = KvPort(prefill_model, "prefill-0")     # each engine's cache, registered
    decode = KvPort(decode_model, "decode-0")
    tokens = hand_off(prefill_engine, prefill, decode_engine, decode, prompt, max_tokens=16)

Across processes (moelink-serve --pd: a prefill worker and a decode worker
behind moelink-scheduler), the decode worker answers a small hand-off
service (HandoffServer: JSON lines over TCP) and the prefill worker calls it
(HandoffClient): "receive" reserves the decode side's pages and names its
cache (descriptor, layout, immediates); the prefill worker writes the pages
(KvPort.send) and reports HANDED_OFF to the scheduler; "resume" waits for
the pages to have arrived and continues the request there.

The model's own cache is registered where it is: host memory on the CPU
path (libfabric's tcp or shm provider), GPU memory on a GPU backend (a
provider with FI_HMEM: shm, and tcp where libfabric was built with CUDA).
"""

from __future__ import annotations

import itertools
import json
import socket
import socketserver
import threading
from typing import Callable, Optional

import moelink

_imm = itertools.count(0x1000, 64)  # immediates per request: one per layer (< 64 layers per block)


class KvPort:
    """One engine's KV cache on a TransferEngine of its own: every layer's
    cache (moelink.Model.kv_cache_region) registered once, with its layout."""

    def __init__(self, model, name: str, provider: str = "auto", timeout_s: float = 30.0):
        att = model.config.attention
        caches = model.num_layers + (1 if model.mtp else 0)
        self.model = model
        self.layout = moelink.KvCacheLayout.layer_major(
            caches, (att.kv_lora_rank + att.qk_rope_head_dim) * 2, model.page_size, model.num_pages)
        # numpy on a host backend, a torch CUDA tensor on a GPU one (registered
        # as GPU memory: the provider must accept FI_HMEM, as shm does).
        self.region_array = model.kv_cache_region()
        if provider == "auto":  # GPU memory: shm moves it on one machine (FI_HMEM); host memory: tcp
            provider = "shm" if hasattr(self.region_array, "is_cuda") else "tcp"
        self.engine = moelink.TransferEngine(provider=provider, name=name, timeout_s=timeout_s)
        try:
            self.region = self.engine.register_memory(self.region_array)
        except moelink.SystemError as e:
            self.engine.close()
            raise moelink.SystemError(f"moelink: KvPort {name}: the model's KV cache could not be registered "
                                      f"with libfabric's {provider} provider: {e}") from e
        self.name = name
        self._peers = {}

    def descriptor(self) -> "moelink.MemoryDescriptor":
        return moelink.MemoryDescriptor.from_bytes(self.engine.descriptor(self.region))

    def describe(self) -> dict:
        """What a remote prefill side needs to write here (JSON-safe)."""
        lo = self.layout
        return {"name": self.name, "descriptor": bytes(self.engine.descriptor(self.region)).hex(),
                "layout": [lo.num_layers, lo.bytes_per_token, lo.tokens_per_page, lo.num_pages]}

    def send(self, remote: dict, prompt_len: int, src_pages, dst_pages, cached_tokens: int, imm_base: int,
             timeout_s: float = 30.0) -> int:
        """Writes the prompt's KV rows into a remote cache (describe()'s dict)
        and waits until the writes completed here; returns the tokens moved."""
        key = remote["descriptor"]  # a restarted decode engine registers anew: a new descriptor
        if key not in self._peers:
            desc = moelink.MemoryDescriptor.from_bytes(bytes.fromhex(key))
            self.engine.add_peer_group([desc])
            self._peers[key] = desc
        layout = moelink.KvCacheLayout.layer_major(*remote["layout"])
        req = _request(prompt_len, src_pages, dst_pages, cached_tokens, self.model.page_size, imm_base)
        if req.num_tokens > 0:
            self.engine.write_kv_cache(self.region, self.layout, self._peers[key], layout, req).wait(timeout_s)
        return req.num_tokens

    def wait(self, prefill_name: str, prompt_len: int, src_pages, dst_pages, cached_tokens: int, imm_base: int,
             timeout_s: float = 30.0) -> None:
        """Returns once the prompt's KV rows a prefill side sent have arrived."""
        req = _request(prompt_len, src_pages, dst_pages, cached_tokens, self.model.page_size, imm_base)
        if req.num_tokens > 0:
            self.engine.wait_kv_cache(self.layout, req, prefill_name, timeout_s=timeout_s)

    def connect(self, peer: "KvPort") -> None:
        """This side will write into `peer`'s cache (a barrier proves the path)."""
        if peer.name in self._peers:
            return
        desc = peer.descriptor()
        group = self.engine.add_peer_group([desc])
        imm = next(_imm)
        self.engine.barrier(group, imm).wait()
        peer.engine.wait_imm(imm, 1)
        self._peers[peer.name] = desc

    def close(self) -> None:
        self.engine.close()


def _request(prompt_len: int, src_pages, dst_pages, cached_tokens: int, page_size: int,
             imm_base: Optional[int] = None):
    """The pages the decode side lacks: from the first page its prefix cache
    does not hold (cached_tokens is a multiple of the page size)."""
    skip = cached_tokens // page_size
    return moelink.KvTransferRequest(prompt_len - skip * page_size, list(src_pages[skip:]),
                                     list(dst_pages[skip:]), imm_base=next(_imm) if imm_base is None else imm_base,
                                     imm_mode="layer")


def next_imm_base() -> int:
    """Immediates for one more request to this process's decode engine."""
    return next(_imm)


# ------------------------------------------------------------------ across processes

class HandoffServer:
    """The decode worker's hand-off service: one JSON object a line each way.
    `handle(message) -> reply` runs on the worker's engine thread (the
    worker queues it there); this only moves lines."""

    def __init__(self, handle: Callable[[dict], dict], host: str = "127.0.0.1", port: int = 0):
        outer = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    try:
                        reply = outer._handle(json.loads(line))
                    except Exception as e:  # a bad line gets a named error, the service goes on
                        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    self.wfile.write((json.dumps(reply) + "\n").encode())
                    self.wfile.flush()

        self._handle = handle
        self._server = socketserver.ThreadingTCPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self.address = "%s:%d" % self._server.server_address
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class HandoffClient:
    """The prefill worker's end of one decode worker's hand-off service."""

    def __init__(self, address: str, timeout_s: float = 30.0):
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._file = self._sock.makefile("rwb")

    def call(self, message: dict) -> dict:
        self._file.write((json.dumps(message) + "\n").encode())
        self._file.flush()
        line = self._file.readline()
        if not line:
            raise ConnectionError("moelink: the decode engine's hand-off service closed the connection")
        return json.loads(line)

    def close(self) -> None:
        self._file.close()
        self._sock.close()


def _run_until_finished(engine, request_id: int, side: str):
    """Steps `engine` until the request finishes; its tokens and finish reason."""
    tokens, finished = [], ""
    while not finished:
        for r in engine.step():
            if r.id == request_id:
                tokens += r.tokens
                finished = r.finished
                if r.error:
                    raise moelink.InputError(f"moelink: hand_off: the {side} engine failed: {r.error}")
    return tokens, finished


def hand_off(prefill_engine, prefill: KvPort, decode_engine, decode: KvPort, prompt, *,
             timeout_s: float = 30.0, **params) -> Optional[dict]:
    """One request through a prefill engine and a decode engine: prefill
    there, the KV rows across, decode here. Returns {"tokens", "finished",
    "transferred_tokens"}; None when the decode engine has no pages for it
    now. Steps both engines itself (for tests and single-process serving;
    both must have no other work in flight)."""
    got = decode_engine.receive(prompt, **params)
    if got is None:
        return None
    did, cached, dst_pages = got
    pid = prefill_engine.add(prompt, hand_off=True, **params)
    try:
        tokens, finished = _run_until_finished(prefill_engine, pid, "prefill")
    except Exception:
        decode_engine.cancel(did)
        raise
    if finished != "handed_off":  # the first token ended it: nothing to move
        decode_engine.cancel(did)
        decode_engine.step()
        return {"tokens": tokens, "finished": finished, "transferred_tokens": 0}
    prefill.connect(decode)
    req = _request(len(prompt), prefill_engine.pages(pid), dst_pages, cached, prefill.model.page_size)
    try:
        t = prefill.engine.write_kv_cache(prefill.region, prefill.layout, decode.descriptor(), decode.layout, req)
        decode.engine.wait_kv_cache(decode.layout, req, prefill.name, timeout_s=timeout_s)
        t.wait(timeout_s)
    except Exception:
        decode_engine.cancel(did)
        decode_engine.step()
        raise
    finally:
        prefill_engine.release(pid)
    decode_engine.resume(did, tokens[-1])
    more, finished = _run_until_finished(decode_engine, did, "decode")
    tokens += more
    return {"tokens": tokens, "finished": finished, "transferred_tokens": req.num_tokens}
