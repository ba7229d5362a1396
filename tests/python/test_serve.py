"""moelink-serve end to end on the CPU path (and on the GPU, backend nvlink,
where there is one): the tiny random model
(moelink.serve.tiny_model: numpy weights, a word-level tokenizer) behind
the OpenAI-compatible API; requests from the official
openai client, streaming and not, against the model's own greedy
generation; errors; concurrency; a client that goes away."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import moelink
from model_testlib import greedy_alone, has_gpu

tokenizers = pytest.importorskip("tokenizers", reason="moelink.serve needs Hugging Face tokenizers")
pytest.importorskip("jinja2", reason="chat templates need jinja2")
pytestmark = pytest.mark.skipif(not moelink._C.with_engine, reason="this build has no engine (xxHash)")

from moelink.serve.tiny_model import write_tiny_model  # noqa: E402

FIELDS = {}  # the tiny model's config, once the fixture wrote it


@pytest.fixture(scope="module", params=["cpu", "nvlink"])
def served(tmp_path_factory, request):
    pytest.importorskip("ml_dtypes")
    if request.param != "cpu" and not has_gpu():
        pytest.skip("the GPU path needs a Hopper GPU (runs on the H200 device machine)")
    d = tmp_path_factory.mktemp("tiny-moe")
    FIELDS.update(write_tiny_model(str(d), layers=2, seed=31))
    opts = moelink.serve.ServerOptions(num_pages=24, page_size=16, max_running=4, token_budget=48,
                                       max_model_len=96, backend=request.param)
    server = moelink.serve.Server(str(d), opts)
    host, port = server.start("127.0.0.1", 0)
    server.directory = str(d)
    server.backend = request.param
    yield server, f"http://{host}:{port}"
    server.stop()
    # Its engine thread and the thread that delivers the steps' outputs end with it.
    assert not server._engine_thread.is_alive() and not server._deliver_thread.is_alive()


def _post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_match_the_models_own_greedy_output(served):
    openai = pytest.importorskip("openai")
    server, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18"
    ids = server.tokenizer.encode(prompt, add_special_tokens=False).ids
    r = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=8, temperature=0)
    text = r.choices[0].text
    want = greedy_alone(server.directory, ids, 8, backend=server.backend)
    assert text == server.tokenizer.decode(want), "the server's text is the model's own greedy output"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 8
    assert r.choices[0].finish_reason in ("length", "stop")
    # The same request streamed gives the same text, and again from the
    # prefix cache the same again.
    chunks = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert client.completions.create(model=server.model_name, prompt=prompt, max_tokens=8,
                                     temperature=0).choices[0].text == text
    # Token ids in, and a stop string cuts the text before it.
    r2 = client.completions.create(model=server.model_name, prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == text
    words = text.split()
    if len(words) >= 3:
        r3 = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=8,
                                       temperature=0, stop=[words[2]])
        assert r3.choices[0].finish_reason == "stop"
        assert r3.choices[0].text == text[:text.find(words[2])]
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    # ignore_eos: max_tokens tokens whatever comes, the same text up to
    # where the model's own output ended.
    got, r5 = _post(url + "/v1/completions", dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True))
    assert got == 200 and r5["usage"]["completion_tokens"] == 8 and r5["choices"][0]["finish_reason"] == "length"
    assert r5["choices"][0]["text"].startswith(text)


def test_metrics_count_the_engines_steps(served):
    server, url = served
    got, _ = _post(url + "/v1/completions", dict(prompt="w3 w4 w5", max_tokens=4, temperature=0))
    assert got == 200
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = dict(line.split() for line in r.read().decode().splitlines() if line and not line.startswith("#"))
    m = {k: float(v) for k, v in m.items()}
    assert m["moelink_engine_steps_total"] >= m["moelink_model_steps_total"] >= m["moelink_decode_steps_total"] > 0
    assert m["moelink_engine_step_seconds_total"] >= m["moelink_model_step_seconds_total"] > 0
    # Engine.step: its C++ part and the GIL wait after it, both inside the Python-side clock.
    assert m["moelink_engine_step_seconds_total"] >= (m["moelink_engine_cxx_step_seconds_total"]
                                                     + m["moelink_engine_gil_wait_seconds_total"]) * 0.999
    assert m["moelink_engine_cxx_step_seconds_total"] >= m["moelink_model_step_seconds_total"]
    assert m["moelink_model_step_seconds_total"] >= m["moelink_decode_step_seconds_total"] > 0
    assert m["moelink_decode_step_requests_total"] >= m["moelink_decode_steps_total"]
    # The graphed decode steps' host / wait split: each part of their time
    # where steps were graphed (GPU, --cuda-graphs), none otherwise.
    graphed = m["moelink_decode_graph_replays_total"] + m["moelink_decode_graph_eager_steps_total"]
    for part in ("host", "wait"):
        assert (m[f"moelink_decode_graph_{part}_seconds_total"] > 0) == (graphed > 0), (part, graphed)


def test_chat_completions_stream_and_not(served):
    openai = pytest.importorskip("openai")
    server, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "w5 w6 w7 w8"}]
    r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=6,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_bad_requests_get_openai_errors_naming_the_field(served):
    server, url = served
    cases = [
        (dict(prompt="w1", max_tokens=0), 400, "max_tokens"),
        (dict(prompt="w1", n=2), 400, "n"),
        (dict(prompt="w1 " * 95, max_tokens=8), 400, "max_tokens"),
        (dict(prompt="", max_tokens=4), 400, "prompt"),
        (dict(prompt=[1, 99999], max_tokens=4), 400, "prompt"),
        (dict(prompt="w1", top_p=0), 400, "top_p"),
        (dict(prompt="w1", ignore_eos="yes"), 400, "ignore_eos"),
        (dict(prompt="w1", model="gpt-4"), 404, "model"),
    ]
    for body, status, param in cases:
        got, err = _post(url + "/v1/completions", body)
        assert got == status, (body, err)
        assert err["error"]["param"] == param and err["error"]["message"], err
    got, err = _post(url + "/v1/completions", None, raw=b"{not json")
    assert got == 400 and "not valid JSON" in err["error"]["message"]
    got, err = _post(url + "/v1/chat/completions", {"messages": "hi"})
    assert got == 400 and err["error"]["param"] == "messages"
    # and the server still serves
    got, ok = _post(url + "/v1/completions", dict(prompt="w1 w2", max_tokens=2, temperature=0))
    assert got == 200 and ok["usage"]["completion_tokens"] >= 1
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_a_failed_engine_makes_health_and_requests_say_503(served):
    """Once the engine's model cannot run again (Engine.failure, as the
    engine thread saw it: set here by hand; tests/python/test_engine.py
    fails a real one), /health answers 503 naming why and requests get
    OpenAI-style 503s instead of queueing; the server itself keeps
    answering."""
    server, url = served
    server._failure = "moelink: CUDA error in cudaStreamSynchronize: an illegal memory access"
    try:
        try:
            urllib.request.urlopen(url + "/health", timeout=10)
            raise AssertionError("/health said ok")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            assert "illegal memory access" in json.loads(e.read())["error"]
        status, body = _post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 503 and body["error"]["type"] == "server_error"
        assert "restart the server" in body["error"]["message"]
    finally:
        server._failure = ""
    status, body = _post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200, body


def test_concurrent_requests_all_finish_and_pages_come_back(served):
    server, url = served
    results, errors = [], []

    def one(i):
        body = dict(prompt=" ".join(f"w{(i * 7 + j) % 400 + 4}" for j in range(10 + i % 13)),
                    max_tokens=5 + i % 4, temperature=0.8, seed=i)
        try:
            results.append(_post(url + "/v1/completions", body))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 16
    assert all(status == 200 and b["choices"][0]["finish_reason"] in ("length", "stop")
               for status, b in results), results
    deadline = time.time() + 10
    while server.kv_pages_free() != server.options.num_pages and time.time() < deadline:
        time.sleep(0.05)
    assert server.kv_pages_free() == server.options.num_pages
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "moelink_requests_running 0" in metrics and "moelink_generated_tokens_total" in metrics


def test_a_client_that_goes_away_frees_its_pages(served):
    server, url = served
    host, port = url[len("http://"):].split(":")
    body = json.dumps(dict(prompt="w1 w2 w3 w4", max_tokens=80, stream=True, temperature=0)).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:  # the stream started
        chunk = s.recv(4096)
        assert chunk, f"the server closed the stream early: {got!r}"
        got += chunk
    s.close()
    deadline = time.time() + 20
    while server.kv_pages_free() != server.options.num_pages and time.time() < deadline:
        time.sleep(0.05)
    assert server.kv_pages_free() == server.options.num_pages, "the request kept its pages"


def test_a_bounded_load_loses_nothing(served):
    """1000 requests, 64 at a time, on loopback: every one completes (or is
    refused naming the field), and every KV page is back afterwards."""
    from concurrent.futures import ThreadPoolExecutor
    server, url = served
    rng = np.random.default_rng(7)

    def one(i):
        n = int(rng.integers(1, 30))
        body = dict(prompt=" ".join(f"w{int(t)}" for t in rng.integers(4, 500, n)),
                    max_tokens=int(rng.integers(1, 4)), temperature=float(rng.choice([0.0, 0.9])),
                    seed=i, stream=bool(i % 5 == 0))
        if i % 97 == 0:
            body["max_tokens"] = 0  # refused, naming the field
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                data = r.read().decode()
            if body.get("stream"):
                return "ok" if data.rstrip().endswith("data: [DONE]") else f"bad stream {data[-200:]}"
            return "ok" if json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop") else data
        except urllib.error.HTTPError as e:
            err = json.loads(e.read())["error"]
            return "refused" if e.code == 400 and err["param"] == "max_tokens" else f"{e.code} {err}"

    t0 = time.time()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(1000)))
    bad = [r for r in results if r not in ("ok", "refused")]
    assert not bad, bad[:5]
    assert results.count("refused") == len(range(0, 1000, 97))
    deadline = time.time() + 10
    while server.kv_pages_free() != server.options.num_pages and time.time() < deadline:
        time.sleep(0.05)
    assert server.kv_pages_free() == server.options.num_pages
    print(f"1000 requests in {time.time() - t0:.1f} s")


@pytest.mark.parametrize("backend", ["cpu", "nvlink"])
def test_speculative_serving_gives_the_models_own_tokens(tmp_path, backend):
    """--speculative on a model whose MTP drafts are often right (the tiny
    model's echo variant): the same text as the model's own greedy output,
    concurrent streams intact, the acceptance counters in /metrics."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("ml_dtypes")
    if backend != "cpu" and not has_gpu():
        pytest.skip("the GPU path needs a Hopper GPU (runs on the H200 device machine)")
    write_tiny_model(str(tmp_path), layers=2, seed=5, num_nextn_predict_layers=1, echo=True)
    opts = moelink.serve.ServerOptions(num_pages=24, page_size=16, max_running=4, token_budget=48,
                                       max_model_len=96, backend=backend, speculative=True)
    server = moelink.serve.Server(str(tmp_path), opts)
    host, port = server.start("127.0.0.1", 0)
    try:
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none")
        prompts = ["w7 w8 w9", "w1 w30 w31 w32 w33", "w100"]
        for p in prompts:
            ids = server.tokenizer.encode(p, add_special_tokens=False).ids
            want = server.tokenizer.decode(greedy_alone(str(tmp_path), ids, 9, backend=backend))
            r = client.completions.create(model=server.model_name, prompt=p, max_tokens=9, temperature=0)
            assert r.choices[0].text == want and r.usage.completion_tokens == 9
            chunks = client.completions.create(model=server.model_name, prompt=p, max_tokens=9, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in chunks) == want
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as m:
            metrics = dict(line.split() for line in m.read().decode().splitlines() if not line.startswith("#"))
        proposed, accepted = (int(metrics[f"moelink_spec_drafts_{k}_total"]) for k in ("proposed", "accepted"))
        assert proposed > 0 and accepted > 0, metrics
    finally:
        server.stop()


def test_model_options_reach_the_workers_as_given():
    """moelink-serve's model options (--num-layers, --cuda-graphs, the MLA
    kernels) are what the engine workers it starts parse back."""
    import argparse

    from moelink.serve.server import ServerOptions, add_model_arguments, model_argv, model_options

    def parser():
        p = argparse.ArgumentParser()
        add_model_arguments(p)
        return p

    for o in (ServerOptions(), ServerOptions(num_layers=3, cuda_graphs=True, decode_kernel="moelink",
                                             prefill_kernel="flashinfer", head_gemm="bf16")):
        back = model_options(parser().parse_args(model_argv(o)))
        assert back == {k: getattr(o, k) for k in back}, back
    with pytest.raises(SystemExit):  # argparse names the choices on stderr
        parser().parse_args(["--prefill-kernel", "fa3"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--head-gemm", "fp16"])


def test_a_worker_whose_engine_failed_reports_everything_failed_and_exits():
    """An engine worker (behind moelink-scheduler) whose engine failed
    (Engine.failure) reports its requests and the runs still queued for it
    as FAILED, answers a pending hand-off call with the error, and stops
    with EngineFailedError (the process exits 1 for a new one to start)."""
    pytest.importorskip("grpc")
    import queue as queue_

    from moelink.scheduler import FAILED, RUNNING, progress
    from moelink.serve.worker import EngineFailedError, EngineWorker

    class FailedEngine:
        failure = "moelink: CUDA error in cudaStreamSynchronize: an illegal memory access"
        idle, running, waiting, available_pages = True, 0, 0, 8

    class Client:
        def __init__(self):
            self.reports = []

        def report(self, load, events, reports):
            self.reports += list(reports)

    class Run:
        request_id = "queued"

    w = EngineWorker.__new__(EngineWorker)  # no scheduler, no model: the failure path alone
    w.engine, w.client, w.engine_id = FailedEngine(), Client(), "e0"
    w._inbox, w._stop, w._counts = queue_.Queue(), threading.Event(), (0, 0, 8)
    w._outbox, w._reporter = queue_.Queue(), threading.Thread(target=w._report_loop, daemon=True)
    w._reporter.start()  # the failure reports go after those queued before them
    w._by_engine, w._by_request = {7: ["running", 3]}, {"running": 7}
    reply = queue_.Queue()
    w._inbox.put(("run", Run()))
    w._inbox.put(("handoff", ({"op": "receive"}, reply)))
    w.step_once = lambda: None  # the step that failed has run
    w._report([progress("earlier", RUNNING, [5], 0)])  # a step's report, queued (not waited for)
    with pytest.raises(EngineFailedError, match="illegal memory access"):
        w.serve_forever()
    w._outbox.put(None)
    w._reporter.join(timeout=10)
    assert not w._reporter.is_alive()
    assert w.client.reports.pop(0).request_id == "earlier"
    got = {r.request_id: r for r in w.client.reports}
    assert set(got) == {"running", "queued"}
    assert all(r.phase == FAILED and "engine 'e0' failed" in r.finish_reason for r in got.values())
    assert got["running"].token_offset == 3
    answer = reply.get_nowait()
    assert answer["ok"] is False and "illegal memory access" in answer["error"]
    assert not w._by_engine and not w._by_request


def test_switch_interval_comes_from_the_environment_and_is_checked(monkeypatch):
    import sys
    from moelink.serve.server import set_switch_interval
    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv("MOELINK_SERVE_SWITCH_INTERVAL_US", raising=False)
        sys.setswitchinterval(1e-3)
        set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(5e-3, abs=2e-6)  # Python's own; kept in whole microseconds, rounded
        monkeypatch.setenv("MOELINK_SERVE_SWITCH_INTERVAL_US", "100")
        set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)
        for bad in ("0", "9", "5001", "fast", "1e2"):
            monkeypatch.setenv("MOELINK_SERVE_SWITCH_INTERVAL_US", bad)
            with pytest.raises(SystemExit, match=f"MOELINK_SERVE_SWITCH_INTERVAL_US = '{bad}' must be an integer "
                                                 "from 10 to 5000"):
                set_switch_interval()
            assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)  # a refused value changes nothing
    finally:
        sys.setswitchinterval(before)
