"""Helpers of the model, engine and serve tests: the tiny model's config
(moelink.serve.tiny_model writes it), a free port, and a request's greedy
tokens on an engine of its own."""

from __future__ import annotations

from moelink.serve.tiny_model import TINY as SMALL  # noqa: F401 (re-exported)
from moelink.serve.tiny_model import write_checkpoint as random_checkpoint  # noqa: F401
from ranks_testlib import free_port  # noqa: F401 (re-exported)


def greedy_alone(model_dir, prompt_ids, max_tokens, eos=1, backend="cpu"):
    """The model's own greedy tokens for one request, on an engine of its
    own (the tiny model's sizes) on `backend`."""
    import moelink
    model = moelink.Model(f"{model_dir}/config.json", backend=backend, max_tokens=48, num_pages=8,
                          page_size=16, max_requests=1, max_pages_per_request=6,
                          bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0))
    model.load_checkpoint(model_dir)
    eng = moelink.Engine(model, num_pages=8, page_size=16, token_budget=48, max_running=1,
                         max_pages_per_request=6)
    i = eng.add(prompt_ids, max_tokens=max_tokens, stop_tokens=[eos])
    return eng.run()[i].tokens
