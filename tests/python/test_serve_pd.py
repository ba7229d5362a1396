"""moelink-serve --engines 2 --pd: moelink-scheduler routes each request to
the prefill worker, naming the decode worker it hands the request to after
its first token; the prompt's KV rows move over the TransferEngine (libfabric
tcp on loopback for the CPU path's host caches, shm for the GPU path's
caches in GPU memory) and the decode worker continues. Requests sent with the
official openai client, streamed and not, give the model's own greedy
output token for token; the scheduler counts the hand-offs and each
worker's pages come back."""

from __future__ import annotations

import os

import pytest

import moelink
from model_testlib import finish_raw_stream, greedy_alone, greedy_runs, local_serving, start_raw_stream

pytest.importorskip("tokenizers")
pytest.importorskip("ml_dtypes")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not (moelink._C.with_engine and moelink.with_fabric),
                                reason="needs the engine (xxHash) and the TransferEngine (libfabric)")
os.environ.setdefault("FI_TCP_IFACE", "lo")


@pytest.fixture(scope="module", params=["cpu", "nvlink"])
def pd_cluster(tmp_path_factory, request):
    # nvlink: the workers' caches in GPU memory, moved over libfabric's shm provider (FI_HMEM).
    yield from local_serving(tmp_path_factory, "tiny-pd", 43, pd=True, backend=request.param)


def test_disaggregated_requests_give_the_models_own_tokens(pd_cluster):
    from moelink.scheduler import SchedulerClient
    serving, url, model_dir = pd_cluster
    assert serving.roles == ["prefill", "decode"]
    client = openai.OpenAI(base_url=url, api_key="none")
    tok = serving.front.tokenizer
    prompts = ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28",
               "w300 w301 w302 w303", "w7"]
    for p in prompts:
        # The second request of a prompt finds its full pages cached on both
        # workers, as the reference's second run does on its one engine.
        want, want_again = (tok.decode(t) for t in greedy_runs(
            model_dir, tok.encode(p, add_special_tokens=False).ids, 7, 2, backend=serving.options.backend))
        r = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=7, temperature=0)
        assert r.choices[0].text == want, (p, serving.logs())
        assert r.usage.completion_tokens == 7
        chunks = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=7,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want_again, serving.logs()
    # One output token: the prefill worker's first token ends it, nothing moves.
    r = client.completions.create(model=serving.front.model_name, prompt=prompts[1], max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1
    with SchedulerClient(serving.scheduler.target) as sc:
        stats = sc.stats()
    assert stats.handed_off == 2 * len(prompts), stats
    roles = {e.engine_id: e.role for e in stats.engines}
    assert sorted(roles.values()) == [1, 2], roles  # ROLE_PREFILL, ROLE_DECODE
    assert all(e.outstanding == 0 for e in stats.engines), stats


def test_a_decode_worker_killed_mid_stream_ends_the_stream_and_rejoins(pd_cluster):
    """The decode worker dies while it streams a handed-off request: the
    stream ends with an error within the heartbeat timeout (never hangs,
    never repeats a token); the worker comes back (a new hand-off address
    and cache) and requests are disaggregated through it again."""
    from moelink.scheduler import SchedulerClient
    serving, url, model_dir = pd_cluster
    prompt = "w40 w41 w42 w43 w44"
    s, got = start_raw_stream(url, prompt, 80, 3)  # past the first token: on the decode worker now
    serving.kill_worker(1)  # engine-1, the decode worker
    got, seconds, text = finish_raw_stream(s, got)
    assert seconds < 30, "the stream hung after its decode worker died"
    assert b'"error"' in got, got[-300:]
    tok = serving.front.tokenizer
    want = tok.decode(greedy_alone(model_dir, tok.encode(prompt, add_special_tokens=False).ids, 80,
                                    backend=serving.options.backend))
    assert want.startswith(text), (text, want)
    serving.start_worker(1)
    with SchedulerClient(serving.scheduler.target) as sc:
        before = sc.stats().handed_off
    client = openai.OpenAI(base_url=url, api_key="none")
    for p in ("w60 w61", "w62 w63 w64"):
        want = tok.decode(greedy_alone(model_dir, tok.encode(p, add_special_tokens=False).ids, 4,
                                    backend=serving.options.backend))
        r = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=4, temperature=0)
        assert r.choices[0].text == want, serving.logs()
    with SchedulerClient(serving.scheduler.target) as sc:
        assert sc.stats().handed_off == before + 2
