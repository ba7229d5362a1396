"""moelink-serve --engines 2 --pd: moelink-scheduler routes each request to
the prefill worker, naming the decode worker it hands the request to after
its first token; the prompt's KV rows move over the TransferEngine (libfabric
tcp on loopback) and the decode worker continues. Requests sent with the
official openai client, streamed and not, give the model's own greedy
output token for token; the scheduler counts the hand-offs and each
worker's pages come back."""

from __future__ import annotations

import os

import pytest

import moelink
from model_testlib import greedy_alone, local_serving

pytest.importorskip("tokenizers")
pytest.importorskip("ml_dtypes")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not (moelink._C.with_engine and moelink.with_fabric),
                                reason="needs the engine (xxHash) and the TransferEngine (libfabric)")
os.environ.setdefault("FI_TCP_IFACE", "lo")


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory):
    yield from local_serving(tmp_path_factory, "tiny-pd", 43, pd=True)


def test_disaggregated_requests_give_the_models_own_tokens(pd_cluster):
    from moelink.scheduler import SchedulerClient
    serving, url, model_dir = pd_cluster
    assert serving.roles == ["prefill", "decode"]
    client = openai.OpenAI(base_url=url, api_key="none")
    tok = serving.front.tokenizer
    prompts = ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28",
               "w300 w301 w302 w303", "w7"]
    for p in prompts:
        want = tok.decode(greedy_alone(model_dir, tok.encode(p, add_special_tokens=False).ids, 7))
        r = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=7, temperature=0)
        assert r.choices[0].text == want, (p, serving.logs())
        assert r.usage.completion_tokens == 7
        chunks = client.completions.create(model=serving.front.model_name, prompt=p, max_tokens=7,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want, serving.logs()
    # One output token: the prefill worker's first token ends it, nothing moves.
    r = client.completions.create(model=serving.front.model_name, prompt=prompts[1], max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1
    with SchedulerClient(serving.scheduler.target) as sc:
        stats = sc.stats()
    assert stats.handed_off == 2 * len(prompts), stats
    roles = {e.engine_id: e.role for e in stats.engines}
    assert sorted(roles.values()) == [1, 2], roles  # ROLE_PREFILL, ROLE_DECODE
    assert all(e.outstanding == 0 for e in stats.engines), stats
