"""moelink-serve in front of moelink-scheduler and two engine workers (one
command's worth of processes): the OpenAI client's requests are routed to
the engines and come back as each engine's own greedy output; a repeated
prompt is routed to the engine that cached it and reports the cached
tokens; the scheduler's index holds exactly what the engines reported."""

from __future__ import annotations


import pytest

import moelink
from model_testlib import finish_raw_stream, greedy_alone, local_serving, start_raw_stream

pytest.importorskip("tokenizers")
pytest.importorskip("ml_dtypes")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not moelink._C.with_engine, reason="this build has no engine (xxHash)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from local_serving(tmp_path_factory, "tiny-moe", 41)


def test_requests_through_the_scheduler_are_each_engines_own_output(cluster):
    serving, url, model_dir = cluster
    client = openai.OpenAI(base_url=url, api_key="none")
    tok = serving.front.tokenizer
    prompts = ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28",
               "w300 w301 w302 w303", "w7 w8 w9"]
    for p in prompts:
        r = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=6,
                                      temperature=0)
        want = tok.decode(greedy_alone(model_dir, tok.encode(p, add_special_tokens=False).ids, 6))
        assert r.choices[0].text == want, (p, serving.logs())
    # The first prompt again: its first full page is cached on the engine
    # that ran it, and the scheduler sends it there.
    r = client.completions.create(model=serving.front.model_name, prompt=prompts[0], max_tokens=6,
                                  temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 16, serving.logs()
    # Streamed through the scheduler too.
    chunks = client.completions.create(model=serving.front.model_name, prompt=prompts[1],
                                       max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(
        greedy_alone(model_dir, tok.encode(prompts[1], add_special_tokens=False).ids, 6))


def test_the_schedulers_index_is_what_the_engines_reported(cluster):
    serving, url, model_dir = cluster
    from moelink.scheduler import SchedulerClient
    with SchedulerClient(serving.scheduler.target) as sc:
        stats = sc.stats()
    assert len(stats.engines) == 2
    assert sum(e.indexed_blocks for e in stats.engines) > 0, stats
    for e in stats.engines:
        assert e.dropped_kv_events == 0 and e.refused_kv_blocks == 0, stats


def test_an_engine_killed_mid_stream_ends_the_stream_and_rejoins(cluster):
    """The engine running a stream dies: the client's stream ends (retried
    elsewhere or with an error naming the failure) within the scheduler's
    heartbeat timeout, never hangs, never repeats a token; the engine comes
    back and takes work again."""
    from moelink.scheduler import SchedulerClient
    serving, url, model_dir = cluster
    s, got = start_raw_stream(url, "w40 w41 w42 w43 w44", 80, 2)
    with SchedulerClient(serving.scheduler.target) as sc:
        busy = [e.engine_id for e in sc.stats().engines if e.outstanding > 0]
    assert len(busy) == 1, busy
    victim = int(busy[0].split("-")[1])  # engine-<i>
    serving.kill_worker(victim)
    got, seconds, text = finish_raw_stream(s, got)
    assert seconds < 30, "the stream hung after its engine died"
    # Greedy output is the same on any engine: what came is a prefix of it,
    # so no token was sent twice or out of order.
    tok = serving.front.tokenizer
    want = tok.decode(greedy_alone(model_dir, tok.encode("w40 w41 w42 w43 w44", add_special_tokens=False).ids, 80))
    assert want.startswith(text), (text, want)
    assert b'"error"' in got or got.endswith(b"data: [DONE]\n\n")
    print("after the kill:", "an error event" if b'"error"' in got else "completed elsewhere")
    # The engine comes back and takes work again.
    serving.start_worker(victim)
    client = openai.OpenAI(base_url=url, api_key="none")
    for p in ("w60 w61", "w62 w63", "w64 w65", "w66 w67"):
        r = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=2,
                                      temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
    with SchedulerClient(serving.scheduler.target) as sc:
        assert len(sc.stats().engines) == 2
