"""Helpers of the model, engine and serve tests: the tiny model's config
(moelink.serve.tiny_model writes it), a free port, whether the GPU
backends can run, and a request's greedy tokens on an engine of its own."""

from __future__ import annotations

import moelink
from moelink.serve.tiny_model import TINY as SMALL  # noqa: F401 (re-exported)
from moelink.serve.tiny_model import write_checkpoint as random_checkpoint  # noqa: F401
from ranks_testlib import free_port  # noqa: F401 (re-exported)



def has_gpu():
    """moelink built with CUDA, torch and a GPU: the GPU backends' tests run."""
    try:
        import torch
    except ImportError:
        return False
    return moelink.with_cuda and torch.cuda.is_available()

def greedy_alone(model_dir, prompt_ids, max_tokens, eos=1, backend="cpu"):
    """The model's own greedy tokens for one request, on an engine of its
    own (the tiny model's sizes) on `backend`."""
    return greedy_runs(model_dir, prompt_ids, max_tokens, 1, eos, backend)[0]


def greedy_runs(model_dir, prompt_ids, max_tokens, runs, eos=1, backend="cpu"):
    """The greedy tokens of `runs` requests of one prompt, one after another
    on one engine of its own: the second and later find the prompt's full
    pages in the prefix cache and prefill only the rest, as a server's
    repeated request does (the reference for it where a GPU's roundings
    could differ between the two paths; on an H100 the tiny model's runs
    gave the same tokens, 2026-12-07)."""
    import moelink
    model = moelink.Model(f"{model_dir}/config.json", backend=backend, max_tokens=48, num_pages=8,
                          page_size=16, max_requests=1, max_pages_per_request=6,
                          bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0))
    model.load_checkpoint(model_dir)
    eng = moelink.Engine(model, num_pages=8, page_size=16, token_budget=48, max_running=1,
                         max_pages_per_request=6)
    out = []
    for _ in range(runs):
        i = eng.add(prompt_ids, max_tokens=max_tokens, stop_tokens=[eos])
        out.append(eng.run()[i].tokens)
    return out


def start_raw_stream(url, prompt, max_tokens, events):
    """A streamed greedy completion on its own socket, read until `events`
    server-sent events came, so that a test can act (kill a worker)
    mid-stream; returns (socket, what came so far)."""
    import json
    import socket
    host, port = url[len("http://"):-len("/v1")].split(":")
    body = json.dumps(dict(prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0)).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < events:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return s, got


def finish_raw_stream(s, got):
    """Reads the rest of start_raw_stream's stream (to [DONE], an error
    event or the connection's end); returns (everything, seconds it took,
    the text its completion chunks carried)."""
    import json
    import time
    t0 = time.monotonic()
    while not got.endswith(b"data: [DONE]\n\n") and b'"error"' not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in got.decode().split("\n")
                   if line.startswith("data: {") and '"choices": [{' in line)
    return got, time.monotonic() - t0, text


def local_serving(tmp_path_factory, name, seed, pd=False, backend="cpu"):
    """moelink-serve over moelink-scheduler and two workers (a prefill and a
    decode worker with pd) on the tiny model on `backend`; yields (serving,
    the API's URL, the model directory). Skips where the scheduler or (a GPU
    backend) the GPU is missing."""
    import pytest

    if backend != "cpu" and not has_gpu():
        pytest.skip("the GPU path needs a Hopper GPU (runs on the H200 device machine)")

    import moelink
    try:
        from moelink.scheduler import SchedulerClient  # noqa: F401 (needs grpcio and the generated code)
        from moelink.scheduler.local_cluster import find_binary
    except ImportError as e:
        pytest.skip(f"moelink.scheduler is not importable: {e}")
    if find_binary("moelink-scheduler") is None:
        pytest.skip("the moelink-scheduler binary is not built (MOELINK_BIN_DIR)")
    from moelink.serve.cluster import LocalServing
    from moelink.serve.tiny_model import write_tiny_model
    d = tmp_path_factory.mktemp(name)
    write_tiny_model(str(d), layers=2, seed=seed)
    opts = moelink.serve.ServerOptions(num_pages=24, page_size=16, max_running=4, token_budget=48,
                                       max_model_len=96, backend=backend)
    serving = LocalServing(str(d), engines=2, options=opts, workdir=str(d / "run"), pd=pd)
    try:
        host, port = serving.start("127.0.0.1", 0)
    except Exception:
        print(serving.logs())
        raise
    try:
        yield serving, f"http://{host}:{port}/v1", str(d)
    finally:
        serving.stop()
