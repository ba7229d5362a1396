"""moelink.Engine on the CPU path: continuous batching of requests with
shared prefixes, chunked prefill mixed with decodes, prefix caching,
preemption when pages run out, cancellation and bad requests, against the
model's own single-request greedy generation."""

from __future__ import annotations

import numpy as np
import pytest

import moelink
from model_testlib import SMALL, free_port, random_checkpoint

pytestmark = pytest.mark.skipif(not moelink._C.with_engine, reason="this build has no engine (xxHash)")

FIELDS = dict(SMALL, rope_scaling=None, num_hidden_layers=2)
PAGE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("ml_dtypes")
    d = tmp_path_factory.mktemp("engine_model")
    random_checkpoint(str(d), FIELDS, seed=21)
    return str(d)


def _model(checkpoint, num_pages):
    m = moelink.Model(f"{checkpoint}/config.json", max_tokens=64, num_pages=num_pages,
                      backend="cpu", page_size=PAGE, max_requests=4, max_pages_per_request=8,
                      bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0))
    m.load_checkpoint(checkpoint)
    return m


def _greedy_alone(model, prompt, max_tokens):
    """The model's own greedy generation for one request: the prompt in one
    step, then one token a step (pages 0, 1, ...)."""
    table = np.arange(8, dtype=np.int32)[None]
    tokens, out = list(prompt), []
    nxt = np.zeros(1, np.int32)
    model.step(np.asarray(tokens, np.int32), np.array([0, len(tokens)], np.int32),
               np.array([len(tokens)], np.int32), table, nxt)
    while True:
        model.check()
        out.append(int(nxt[0]))
        tokens.append(int(nxt[0]))
        if len(out) == max_tokens:
            return out
        model.step(np.asarray(tokens[-1:], np.int32), np.array([0, 1], np.int32),
                   np.array([len(tokens)], np.int32), table, nxt, num_decode=1)


def _engine(model, num_pages, budget=24):
    return moelink.Engine(model, num_pages=num_pages, page_size=PAGE, token_budget=budget,
                          max_running=4, max_pages_per_request=8)


def _prompts(rng):
    stem = rng.integers(0, 512, 40).tolist()  # shared by a and b: two full pages and more
    return {"a": stem + rng.integers(0, 512, 5).tolist(),
            "b": stem + rng.integers(0, 512, 9).tolist(),
            "c": rng.integers(0, 512, 21).tolist()}


def test_batched_generation_equals_one_request_at_a_time(checkpoint):
    rng = np.random.default_rng(5)
    prompts = _prompts(rng)
    alone = _model(checkpoint, num_pages=8)
    want = {k: _greedy_alone(alone, p, 6) for k, p in prompts.items()}
    model = _model(checkpoint, num_pages=32)
    eng = _engine(model, 32)
    ids = {k: eng.add(p, max_tokens=6) for k, p in prompts.items()}
    done = eng.run()
    for k, i in ids.items():
        assert done[i].finished == "length"
        assert done[i].tokens == want[k], f"request {k}"
    # The same prompts again: their full pages come from the prefix cache,
    # and the output is the same.
    ids2 = {k: eng.add(p, max_tokens=6) for k, p in prompts.items()}
    done2 = eng.run()
    for k, i in ids2.items():
        assert done2[i].tokens == want[k], f"request {k} from the cache"
        assert done2[i].cached_tokens == (len(prompts[k]) - 1) // PAGE * PAGE
    assert eng.available_pages == 32, "every page back in the pool (cached or free)"


def test_without_prefix_caching_the_same_prompts_are_computed_again(checkpoint):
    rng = np.random.default_rng(6)
    prompts = _prompts(rng)
    model = _model(checkpoint, num_pages=32)
    eng = moelink.Engine(model, num_pages=32, page_size=PAGE, token_budget=24, max_running=4,
                         max_pages_per_request=8, prefix_caching=False)
    want = {}
    for rnd in range(2):
        ids = {k: eng.add(p, max_tokens=4) for k, p in prompts.items()}
        done = eng.run()
        for k, i in ids.items():
            assert done[i].cached_tokens == 0, f"round {rnd}, request {k}"
            assert want.setdefault(k, done[i].tokens) == done[i].tokens
        assert eng.cached_pages == 0 and eng.available_pages == 32
    t = eng.step_times
    assert t["steps"] >= 2 * 4 and t["seconds"] > 0
    # Chunked prefills of 45 + 49 + 21 tokens at 24 a step, then decodes.
    assert 0 < t["decode_steps"] < t["steps"] and 0 < t["decode_seconds"] < t["seconds"]
    assert t["decode_steps"] <= t["decode_requests"] <= 3 * t["decode_steps"]
    # step() itself: its C++ part holds the model's steps; the GIL wait after it is small here.
    assert t["step_seconds"] >= t["seconds"] and 0 <= t["gil_wait_seconds"] < t["step_seconds"]


def test_preemption_cancellation_and_stop_tokens(checkpoint):
    rng = np.random.default_rng(6)
    prompts = _prompts(rng)
    alone = _model(checkpoint, num_pages=8)
    want = {k: _greedy_alone(alone, p, 12) for k, p in prompts.items()}
    # Too few pages for all three to run to the end at once: someone is
    # preempted and recomputed; nothing crashes, everyone finishes.
    model = _model(checkpoint, num_pages=7)
    eng = _engine(model, 7, budget=32)
    ids = {k: eng.add(p, max_tokens=12) for k, p in prompts.items()}
    done = eng.run()
    assert eng.preemptions > 0
    for k, i in ids.items():
        assert done[i].finished == "length" and len(done[i].tokens) == 12, k
    # Until a request was preempted its tokens are the model's own; after,
    # it recomputes its context in prefill form (another fp8 data flow, which
    # may pick another token where two are close), so only each request's
    # first token (made before any page ran out) is compared here.
    for k, i in ids.items():
        assert done[i].tokens[:1] == want[k][:1], k
    assert eng.available_pages == 7
    # Cancellation frees the pages at the next step.
    i = eng.add(prompts["c"], max_tokens=50)
    eng.step()
    eng.cancel(i)
    res = {r.id: r for r in eng.step()}
    assert res[i].finished == "cancelled"
    assert eng.idle and eng.available_pages == 7
    # A stop token ends a request, and is its last token.
    stop = want["c"][3]
    i = eng.add(prompts["c"], max_tokens=12, stop_tokens=[stop])
    g = eng.run()[i]
    assert g.finished == "stop" and g.tokens[-1] == stop and len(g.tokens) <= 4


def test_bad_requests_are_refused_naming_the_field(checkpoint):
    model = _model(checkpoint, num_pages=8)
    eng = _engine(model, 8)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add([], max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens = 0"):
        eng.add([1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the 128 tokens"):
        eng.add([1] * 100, max_tokens=40)
    with pytest.raises(ValueError, match="token 1 = 9999"):
        eng.add([1, 9999], max_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        eng.add([1, 2], top_p=0.0)
    i = eng.add([1, 2, 3], max_tokens=2)  # and the engine still works
    assert eng.run()[i].finished == "length"


def _rank_that_leaves(checkpoint, port, q):
    """Rank 1: builds its half of the model, then exits without a step."""
    try:
        m = moelink.Model(f"{checkpoint}/config.json", max_tokens=64, num_pages=16, backend="cpu",
                          page_size=PAGE, max_requests=4, max_pages_per_request=8, timeout_s=5.0,
                          bootstrap=moelink.TcpBootstrap(1, 2, "127.0.0.1", port, 30.0))
        m.load_checkpoint(checkpoint)
        q.put("ok")
    except Exception as e:  # reported by the parent
        q.put(f"{type(e).__name__}: {e}")


def test_a_peer_rank_gone_fails_the_engine_once_and_for_all(checkpoint):
    """Rank 1 of an expert-parallel pair exits: rank 0's next step fails
    within the timeout, every request ends "error" naming why, the engine
    reports the failure and refuses new requests (moelink.SystemError)
    instead of failing them one step at a time."""
    import multiprocessing as mp
    import time
    port = free_port()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    peer = ctx.Process(target=_rank_that_leaves, args=(checkpoint, port, q))
    peer.start()
    m = moelink.Model(f"{checkpoint}/config.json", max_tokens=64, num_pages=16, backend="cpu",
                      page_size=PAGE, max_requests=4, max_pages_per_request=8, timeout_s=5.0,
                      bootstrap=moelink.TcpBootstrap(0, 2, "127.0.0.1", port, 30.0))
    m.load_checkpoint(checkpoint)
    assert q.get(timeout=60) == "ok"
    peer.join(timeout=30)
    eng = _engine(m, 16)
    assert eng.failure == ""
    rng = np.random.default_rng(5)
    ids = [eng.add(rng.integers(0, 512, n).tolist(), max_tokens=4) for n in (5, 30, 40)]
    t0 = time.monotonic()
    ended = {}
    while len(ended) < len(ids) and time.monotonic() - t0 < 60:
        for r in eng.step():
            if r.finished:
                ended[r.id] = r
    assert time.monotonic() - t0 < 30, "the dead peer was not noticed within the timeout"
    assert sorted(ended) == sorted(ids), "a request never ended"
    assert all(r.finished == "error" and r.error for r in ended.values()), ended
    assert eng.failure and eng.failure in ended[ids[0]].error + ended[ids[-1]].error
    assert eng.idle and eng.step() == []
    with pytest.raises(moelink.SystemError, match="failed at an earlier step"):
        eng.add([1, 2, 3])
