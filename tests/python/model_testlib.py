"""Helpers of the model, engine and serve tests: the tiny model's config
(moelink.serve.tiny_model writes it) and a free port."""

from __future__ import annotations

import socket

from moelink.serve.tiny_model import TINY as SMALL  # noqa: F401 (re-exported)
from moelink.serve.tiny_model import write_checkpoint as random_checkpoint  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
