"""Prefill/decode disaggregation's KV hand-off (moelink.serve.disagg) on the
CPU path (host memory) and on the GPU path (the models' caches in GPU
memory, registered with FI_HMEM; skipped without a GPU or a provider that
takes it): a request prefilled on one engine (its model's own KV cache),
its prompt's KV rows moved over the TransferEngine (libfabric tcp and shm on
loopback) into the pages a second engine reserved, decoded there: the same
tokens as one engine running it alone (greedy and sampled, an MTP model
too), the moved pages byte-equal, prefix-cached pages not moved again, the
pages of both engines back afterwards; a transfer that never comes ends in
TimeoutError naming the prefill engine and frees the decode side's pages."""

from __future__ import annotations

import os

import numpy as np
import pytest

import moelink
from model_testlib import free_port, has_gpu
from moelink.serve.tiny_model import write_tiny_model

pytestmark = pytest.mark.skipif(not (moelink._C.with_engine and moelink.with_fabric),
                                reason="needs the engine (xxHash) and the TransferEngine (libfabric)")
os.environ.setdefault("FI_TCP_IFACE", "lo")

PAGE = 16


@pytest.fixture(scope="module", params=[0, 1], ids=["plain", "mtp"])
def checkpoint(tmp_path_factory, request):
    pytest.importorskip("ml_dtypes")
    d = tmp_path_factory.mktemp(f"pd-{request.param}")
    write_tiny_model(str(d), layers=2, seed=int(np.random.default_rng().integers(1 << 30)),
                     num_nextn_predict_layers=request.param)
    return str(d), bool(request.param)


BACKENDS = ["cpu", "nvlink"]


def _engine(directory, mtp, backend, num_pages=24):
    if backend != "cpu" and not has_gpu():
        pytest.skip("the GPU path needs a Hopper GPU (runs on the H200 device machine)")
    model = moelink.Model(f"{directory}/config.json", max_tokens=64, num_pages=num_pages, backend=backend,
                          page_size=PAGE, max_requests=4, max_pages_per_request=8, mtp=mtp,
                          bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0))
    model.load_checkpoint(directory)
    eng = moelink.Engine(model, num_pages=num_pages, page_size=PAGE, token_budget=32, max_running=4,
                         max_pages_per_request=8, speculative=mtp)
    return model, eng


def _ports(pm, dm, provider):
    from moelink.serve.disagg import KvPort
    try:
        p = KvPort(pm, "prefill-0", provider=provider, timeout_s=10.0)
    except moelink.SystemError as e:  # no such provider, or (GPU memory) one without FI_HMEM
        pytest.skip(f"libfabric provider {provider} unavailable for this cache: {e}")
    return p, KvPort(dm, "decode-0", provider=provider, timeout_s=10.0)


def _host(region):
    """A cache region's bytes on the host (numpy; a GPU tensor copied)."""
    return region.cpu().numpy() if hasattr(region, "cpu") else region


@pytest.mark.parametrize("provider", ["tcp", "shm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_handed_off_requests_decode_to_the_models_own_tokens(checkpoint, backend, provider):
    from moelink.serve.disagg import hand_off
    directory, mtp = checkpoint
    _, alone = _engine(directory, mtp, backend)
    pm, pe = _engine(directory, mtp, backend)
    dm, de = _engine(directory, mtp, backend)
    prefill, decode = _ports(pm, dm, provider)
    rng = np.random.default_rng()
    shared = [int(t) for t in rng.integers(4, 512, 37)]
    reqs = [(shared + [5, 6, 7], dict(max_tokens=12)),
            (shared + [9], dict(max_tokens=9, temperature=0.8, seed=3)),  # 2 of its pages cached on decode
            ([int(t) for t in rng.integers(4, 512, 5)], dict(max_tokens=1)),  # ends on its first token
            ([int(t) for t in rng.integers(4, 512, 16)], dict(max_tokens=20, temperature=1.3, top_k=50, seed=9))]
    try:
        for k, (prompt, kw) in enumerate(reqs):
            i = alone.add(prompt, **kw)
            want = alone.run()[i]
            got = hand_off(pe, prefill, de, decode, prompt, **kw)
            assert got["tokens"] == want.tokens, f"request {k}"
            assert got["finished"] == want.finished
            if k == 1:  # the shared prefix's two full pages were on the decode side already
                assert got["transferred_tokens"] == len(prompt) - 2 * PAGE
            elif k == 2:
                assert got["finished"] == "length" and got["transferred_tokens"] == 0
            else:
                assert got["transferred_tokens"] == len(prompt)
            assert pe.idle and de.idle
            assert pe.available_pages == 24 and de.available_pages == 24
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_moved_pages_are_byte_equal_and_a_missing_transfer_times_out(checkpoint, backend):
    from moelink.serve.disagg import _request
    directory, mtp = checkpoint
    pm, pe = _engine(directory, mtp, backend)
    dm, de = _engine(directory, mtp, backend)
    prefill, decode = _ports(pm, dm, "tcp" if backend == "cpu" else "shm")
    try:
        prompt = [int(t) for t in np.random.default_rng().integers(4, 512, 41)]
        did, cached, dst_pages = de.receive(prompt, max_tokens=4)
        assert cached == 0 and len(dst_pages) == 3
        pid = pe.add(prompt, max_tokens=4, hand_off=True)
        res = {}
        while pid not in res:
            res.update({r.id: r for r in pe.step() if r.finished})
        assert res[pid].finished == "handed_off" and len(res[pid].tokens) == 1
        src_pages = pe.pages(pid)
        prefill.connect(decode)
        req = _request(len(prompt), src_pages, dst_pages, cached, PAGE)
        prefill.engine.write_kv_cache(prefill.region, prefill.layout, decode.descriptor(), decode.layout,
                                      req).wait(10.0)
        decode.engine.wait_kv_cache(decode.layout, req, "prefill-0", timeout_s=10.0)
        src, dst = _host(prefill.region_array), _host(decode.region_array)
        for layer in range(prefill.layout.num_layers):
            for j, (s, d) in enumerate(zip(src_pages, dst_pages)):
                n = min(PAGE, len(prompt) - j * PAGE) * prefill.layout.bytes_per_token
                so, do = prefill.layout.page_offset(layer, s), decode.layout.page_offset(layer, d)
                assert np.array_equal(src[so:so + n], dst[do:do + n])
                assert src[so:so + n].any()
        pe.release(pid)
        assert pe.available_pages == 24
        with pytest.raises(moelink.InvalidArgument, match="not waiting for its KV"):
            de.resume(did + 100, 7)
        de.resume(did, res[pid].tokens[0])
        out = []
        while not de.idle:
            out += [t for r in de.step() for t in r.tokens]
        assert len(out) == 3
        # A request whose KV never comes: the wait names the prefill engine;
        # cancelling it gives the decode side's pages back.
        did, _, dst_pages = de.receive(prompt, max_tokens=4)
        req = _request(len(prompt), src_pages, dst_pages, 32, PAGE)
        with pytest.raises(moelink.TimeoutError, match="prefill-0"):
            decode.engine.wait_kv_cache(decode.layout, req, "prefill-0", timeout_s=0.5)
        de.cancel(did)
        assert [r.finished for r in de.step()] == ["cancelled"]
        assert de.available_pages == 24 and de.idle
    finally:
        prefill.close()
        decode.close()
