"""Smoke test of tools/bench/kv_bench: each engine that imports here moves a
tiny case (3 layers, 100 tokens: a partial last page, concurrency 2) between
a prefill and a decode process and verifies it; a corrupted page must make
the decode worker fail naming the layer and page. Engines that cannot run
here are skipped with the probe's reason."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KV_BENCH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "bench", "kv_bench")
sys.path.insert(0, KV_BENCH)

pytest.importorskip("xxhash")
np = pytest.importorskip("numpy")

import common  # noqa: E402
import runner  # noqa: E402

_PROBES = {}


def _probe(engine):
    if engine not in _PROBES:
        _PROBES[engine] = runner.probe_engine(engine, timeout_s=60)
    return _PROBES[engine]


def _tiny(transport, **kw):
    return common.Case(model="tiny", layers=3, bytes_per_token_layer=256, tokens_per_page=16, tokens=100,
                       concurrency=2, transport=transport, src_pool_pages=16, warmup=1, iters=2, **kw)


def _cells():
    out = []
    for engine in runner.ENGINES:
        for transport in common.TRANSPORT_CLASSES:
            if runner.TRANSPORTS[engine].get(transport) is not None:
                out.append((engine, transport))
    return out


def _need(engine):
    p = _probe(engine)
    if not p.get("ok"):
        pytest.skip(f"{engine} cannot run here: {p.get('error')}")


@pytest.mark.parametrize("engine,transport", _cells())
def test_moves_and_verifies(engine, transport, tmp_path):
    _need(engine)
    case = _tiny(transport)
    cell = runner.run_pair(engine, case, str(tmp_path), "ok", timeout_s=25, op_timeout_s=10)
    assert cell["ok"], cell.get("error")
    d = cell["decode"]
    assert d["verified_pages"] == (case.warmup + case.iters) * case.concurrency * case.layers * case.request_pages
    assert len(d["latency_ns"]) == case.iters * case.concurrency
    assert all(x > 0 for x in d["latency_ns"])
    # From the batch's start is never shorter than from the request's own issue.
    assert len(d["latency_from_start_ns"]) == len(d["latency_ns"])
    assert all(s >= x for s, x in zip(d["latency_from_start_ns"], d["latency_ns"]))
    assert len(d["issue_ns"]) == len(d["latency_ns"]) and all(x >= 0 for x in d["issue_ns"])
    assert cell["prefill"]["cpu_s"] >= 0 and d["cpu_s"] >= 0


@pytest.mark.parametrize("engine", [e for e in runner.ENGINES])
def test_corrupted_page_fails(engine, tmp_path):
    _need(engine)
    transport = "tcp"
    case = _tiny(transport)
    cell = runner.run_pair(engine, case, str(tmp_path), "bad", timeout_s=25, op_timeout_s=10,
                           extra_decode_args=["--corrupt-for-test"])
    assert not cell["ok"]
    assert cell["rc"]["decode"] == 3, cell
    err = cell["decode"]["error"]
    assert f"{engine}: verification failed: layer {case.layers // 2}" in err and "decode page" in err, err


def test_verify_catches_writes_outside_the_request():
    case = _tiny("shm")
    rng = np.random.default_rng(0)
    src_pool = common.alloc_pool(case.layers, case.src_pool_pages, case.page_bytes)
    common.fill_source_pool(src_pool, case.seed)
    sums = common.source_checksums(src_pool, case)
    dst_pool = common.alloc_pool(case.layers, case.dst_pool_pages, case.page_bytes)
    dst, src = common.alloc_dst_pages(rng, case), common.pick_src_pages(rng, case)
    lens = case.page_lengths()
    for r in range(case.concurrency):
        for layer in range(case.layers):
            for j in range(case.request_pages):
                dst_pool[layer, dst[r, j], :lens[j]] = src_pool[layer, src[r, j], :lens[j]]
    assert common.verify_and_clear("test", dst_pool, case, dst, src, sums) == \
        case.concurrency * case.layers * case.request_pages
    assert not dst_pool.any()
    # A write past the partial last page's end is outside the request.
    for r in range(case.concurrency):
        for layer in range(case.layers):
            for j in range(case.request_pages):
                dst_pool[layer, dst[r, j], :lens[j]] = src_pool[layer, src[r, j], :lens[j]]
    dst_pool[1, dst[0, -1], lens[-1]] = 7
    with pytest.raises(common.VerificationError, match="written outside"):
        common.verify_and_clear("test", dst_pool, case, dst, src, sums)


def test_page_content_depends_on_page_id_only():
    a = common.alloc_pool(2, 4, 512)
    b = common.alloc_pool(2, 8, 512)
    common.fill_source_pool(a, 5)
    common.fill_source_pool(b, 5)
    assert np.array_equal(a, b[:, :4])
    assert not np.array_equal(a[0, 0], a[0, 1]) and not np.array_equal(a[0, 0], a[1, 0])


def test_budget_skips_deepseek_32k_x16():
    case = common.model_case("deepseek-v3", 32768, 16, "shm")
    assert case.page_bytes == 73728 and case.layers * case.bytes_per_token_layer == 70272
    reason = common.budget_skip_reason(case, 8.0)
    assert reason and "exceeds --mem-budget-gib 8" in reason
    llama = common.model_case("llama-3-70b", 1024, 1, "tcp")
    assert llama.page_bytes == 65536 and common.budget_skip_reason(llama, 8.0) is None
