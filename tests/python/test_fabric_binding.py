"""moelink.TransferEngine from Python: two engines in one process (libfabric
shm, and tcp on loopback) move a request's KV pages between numpy pools with
write_kv_cache / wait_kv_cache; every page is compared with the source page
it came from (numpy is the reference), nothing else is written; bad input and
a missing peer get the errors the engine promises."""

from __future__ import annotations

import os

import numpy as np
import pytest

moelink = pytest.importorskip("moelink")
if not moelink.with_fabric:
    pytest.skip("moelink was built without libfabric", allow_module_level=True)

os.environ.setdefault("FI_TCP_IFACE", "lo")


def engine_pair(provider):
    try:
        a = moelink.TransferEngine(provider=provider, name="prefill", timeout_s=10.0)
    except moelink.SystemError as e:  # the provider is missing here
        pytest.skip(f"libfabric provider {provider} unavailable: {e}")
    b = moelink.TransferEngine(provider=provider, name="decode", timeout_s=10.0)
    return a, b


def pages_of(pool, layout, layer, pages, tokens):
    """The bytes of `pages` of `layer` in a pool, the last one cut to the
    request's tokens."""
    out = []
    per_page = layout.tokens_per_page
    for i, p in enumerate(pages):
        n = min(per_page, tokens - i * per_page) * layout.bytes_per_token
        off = layout.page_offset(layer, int(p))
        out.append(pool[off:off + n].copy())
    return out


@pytest.mark.parametrize("provider", ["shm", "tcp"])
@pytest.mark.parametrize("imm_mode", ["layer", "request"])
def test_kv_pages_arrive_where_the_request_says(provider, imm_mode):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    rng = np.random.default_rng(seed)
    layers, bytes_per_token, tokens_per_page = 5, 96, 16
    src_layout = moelink.KvCacheLayout.layer_major(layers, bytes_per_token, tokens_per_page, 12)
    dst_layout = moelink.KvCacheLayout.page_major(layers, bytes_per_token, tokens_per_page, 40)
    src = rng.integers(0, 256, src_layout.required_bytes, dtype=np.uint8)
    a, b = engine_pair(provider)
    with a, b:
        src_region = a.register_memory(src)
        dst = np.zeros(dst_layout.required_bytes, dtype=np.uint8)
        dst_region = b.register_memory(dst)
        peer = moelink.MemoryDescriptor.from_bytes(b.descriptor(dst_region))
        assert peer.name == "decode" and peer.size == dst.nbytes
        group = a.add_peer_group([peer])
        a.barrier(group, 0xFFF0).wait()
        b.wait_imm(0xFFF0, 1)
        for it, tokens in enumerate((1, 16, 100, 17 * 16 - 3)):
            n_pages = -(-tokens // tokens_per_page)
            src_pages = rng.integers(0, 12, n_pages).tolist()  # sources may repeat
            dst_pages = rng.permutation(40)[:n_pages].tolist()
            req = moelink.KvTransferRequest(tokens, src_pages, dst_pages, imm_base=0x100 + 64 * it,
                                            imm_mode=imm_mode)
            assert moelink.kv_request_bytes(src_layout, req) == layers * tokens * bytes_per_token
            t = a.write_kv_cache(src_region, src_layout, peer, dst_layout, req)
            b.wait_kv_cache(dst_layout, req, "prefill", timeout_s=10.0)
            t.wait()
            assert t.done()
            for layer in range(layers):
                got = pages_of(dst, dst_layout, layer, dst_pages, tokens)
                want = pages_of(src, src_layout, layer, src_pages, tokens)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert np.array_equal(g, w), f"seed {seed}: layer {layer} page {i}"
                for p, g in zip(dst_pages, got):
                    off = dst_layout.page_offset(layer, p)
                    dst[off:off + len(g)] = 0
            assert not dst.any(), f"seed {seed}: bytes written outside the request's pages"


def test_bad_input_and_a_missing_peer():
    a, b = engine_pair("shm")
    with a, b:
        layout = moelink.KvCacheLayout.layer_major(2, 64, 16, 4)
        src = np.zeros(layout.required_bytes, dtype=np.uint8)
        dst = np.zeros(layout.required_bytes, dtype=np.uint8)
        src_region = a.register_memory(src)
        desc = bytes(b.descriptor(b.register_memory(dst)))
        peer = moelink.MemoryDescriptor.from_bytes(desc)
        # A descriptor cut short in transit, or not one at all.
        for junk in (desc[:-1], desc[: len(desc) // 2], b"garbage"):
            with pytest.raises(moelink.InvalidArgument, match="MemoryDescriptor"):
                moelink.MemoryDescriptor.from_bytes(junk)
        with pytest.raises(moelink.InvalidArgument, match="writable"):
            a.register_memory(b"read-only bytes")
        with pytest.raises(moelink.InvalidArgument, match="imm_mode 'nope'"):
            moelink.KvTransferRequest(16, [0], [0], imm_mode="nope")
        # A page beyond the pool, and a destination page twice: refused, nothing posted.
        with pytest.raises(moelink.InvalidArgument, match="4"):
            a.write_kv_cache(src_region, layout, peer, layout, moelink.KvTransferRequest(16, [0], [4]))
        with pytest.raises(moelink.InvalidArgument):
            a.write_kv_cache(src_region, layout, peer, layout,
                             moelink.KvTransferRequest(32, [0, 1], [2, 2]))
        assert not dst.any()
        # Waiting for pages nobody sends: TimeoutError naming the peer, in time.
        with pytest.raises(moelink.TimeoutError, match="prefill"):
            b.wait_kv_cache(layout, moelink.KvTransferRequest(16, [0], [1], imm_base=7), "prefill",
                            timeout_s=0.3)
        a.deregister_memory(src_region)
        with pytest.raises(moelink.InvalidArgument, match="not registered"):
            a.descriptor(src_region)
    with pytest.raises(moelink.InvalidArgument, match="closed"):
        a.register_memory(np.zeros(8, dtype=np.uint8))
