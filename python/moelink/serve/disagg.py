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

Host memory (the CPU path) from Python; libfabric's tcp or shm provider on
one machine.
"""

from __future__ import annotations

import itertools
from typing import Optional

import moelink

_imm = itertools.count(0x1000, 64)  # immediates per request: one per layer (< 64 layers per block)


class KvPort:
    """One engine's KV cache on a TransferEngine of its own: every layer's
    cache (moelink.Model.kv_cache_region) registered once, with its layout."""

    def __init__(self, model, name: str, provider: str = "tcp", timeout_s: float = 30.0):
        att = model.config.attention
        caches = model.num_layers + (1 if model.mtp else 0)
        self.model = model
        self.layout = moelink.KvCacheLayout.layer_major(
            caches, (att.kv_lora_rank + att.qk_rope_head_dim) * 2, model.page_size, model.num_pages)
        self.region_array = model.kv_cache_region()
        if not isinstance(self.region_array, __import__("numpy").ndarray):
            raise moelink.InvalidArgument(
                "moelink: KvPort: the model's cache is GPU memory; from Python the TransferEngine "
                "registers host memory only (a host backend: cpu)")
        self.engine = moelink.TransferEngine(provider=provider, name=name, timeout_s=timeout_s)
        self.region = self.engine.register_memory(self.region_array)
        self.name = name
        self._peers = {}

    def descriptor(self) -> "moelink.MemoryDescriptor":
        return moelink.MemoryDescriptor.from_bytes(self.engine.descriptor(self.region))

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


def _request(prompt_len: int, src_pages, dst_pages, cached_tokens: int, page_size: int):
    """The pages the decode side lacks: from the first page its prefix cache
    does not hold (cached_tokens is a multiple of the page size)."""
    skip = cached_tokens // page_size
    return moelink.KvTransferRequest(prompt_len - skip * page_size, list(src_pages[skip:]),
                                     list(dst_pages[skip:]), imm_base=next(_imm), imm_mode="layer")


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
    tokens, finished = [], ""
    while not finished:
        for r in prefill_engine.step():
            if r.id == pid:
                tokens += r.tokens
                finished = r.finished
                if r.error:
                    decode_engine.cancel(did)
                    raise moelink.InputError(f"moelink: hand_off: the prefill engine failed: {r.error}")
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
    finished = ""
    while not finished:
        for r in decode_engine.step():
            if r.id == did:
                tokens += r.tokens
                finished = r.finished
                if r.error:
                    raise moelink.InputError(f"moelink: hand_off: the decode engine failed: {r.error}")
    return {"tokens": tokens, "finished": finished, "transferred_tokens": req.num_tokens}
