"""moelink.Engine: the serving engine's step loop (continuous batching,
chunked prefill mixed with decode, prefix caching, preemption by recompute)
over a moelink.Model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from . import _C


@dataclass
class StepResult:
    id: int
    tokens: List[int]     # new output tokens this step (0, 1, or 2 with an accepted draft)
    finished: str         # "", "stop", "length", "cancelled" or "error"
    cached_tokens: int    # prompt tokens found in the prefix cache (first step)
    error: str = ""


@dataclass
class Generation:
    id: int
    tokens: List[int] = field(default_factory=list)
    finished: str = ""
    cached_tokens: int = 0
    error: str = ""


class Engine:
    """Engine(model, *, num_pages, page_size, token_budget, max_running,
    max_pages_per_request, speculative=False, prefix_caching=True) over a
    moelink.Model (the page size and capacities its attention was created
    with). add() queues a request, step() runs one round; run() steps until
    every request finished. speculative=True (a Model(mtp=True)) sends each
    decode's MTP draft along for verification: the same tokens, up to two a
    step. prefix_caching=False never shares a page between requests (the
    baseline of the prefix cache's gain)."""

    def __init__(self, model, *, num_pages: int, page_size: int, token_budget: int,
                 max_running: int, max_pages_per_request: int, speculative: bool = False,
                 prefix_caching: bool = True):
        if not _C.with_engine:
            raise RuntimeError("moelink: this build has no serving engine (it needs xxHash: "
                               "apt-get install libxxhash-dev, and rebuild)")
        self._model = model  # the engine runs it: kept alive as long as the engine
        self._impl = _C.Engine(model._impl, int(num_pages), int(page_size), int(token_budget),
                               int(max_running), int(max_pages_per_request), bool(speculative),
                               bool(prefix_caching))

    def add(self, prompt: Sequence[int], *, max_tokens: int = 16, temperature: float = 0.0,
            top_k: int = 0, top_p: float = 1.0, seed: int = 0,
            stop_tokens: Sequence[int] = (), hand_off: bool = False) -> int:
        """Queues a request; returns its id. hand_off=True (P/D, prefill
        side): it stops after its first token, finishing "handed_off" with
        its pages held for a decode engine until release(id)."""
        return self._impl.add([int(t) for t in prompt], int(max_tokens), float(temperature),
                              int(top_k), float(top_p), int(seed), [int(t) for t in stop_tokens],
                              bool(hand_off))

    def receive(self, prompt: Sequence[int], *, max_tokens: int = 16, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = ()):
        """P/D, decode side: a request whose prompt a prefill engine computed.
        Returns (id, cached_tokens, pages): the prompt's pages in token order,
        the first cached_tokens of which the prefix cache already holds (no
        transfer needed); None when the pages do not suffice now. Move the
        prompt's KV rows into the other pages, then resume(id, first_token)."""
        return self._impl.receive([int(t) for t in prompt], int(max_tokens), float(temperature),
                                  int(top_k), float(top_p), int(seed), [int(t) for t in stop_tokens])

    def resume(self, request_id: int, first_token: int) -> None:
        """The received request's KV rows are in: it decodes on after
        first_token (reported by the prefill engine, not again here)."""
        self._impl.resume(int(request_id), int(first_token))

    def release(self, request_id: int) -> None:
        """P/D, prefill side: frees a handed-off request's pages."""
        self._impl.release(int(request_id))

    def pages(self, request_id: int) -> List[int]:
        """The KV-cache pages a request holds, in token order ([] if none)."""
        return list(self._impl.pages(int(request_id)))

    def cancel(self, request_id: int) -> None:
        self._impl.cancel(int(request_id))

    def step(self) -> List[StepResult]:
        return [StepResult(*r) for r in self._impl.step()]

    def run(self, max_steps: int = 100000) -> dict:
        """Steps until idle; returns {id: Generation} of the requests that
        finished meanwhile."""
        done = {}
        for _ in range(max_steps):
            if self._impl.idle:
                return done
            for r in self.step():
                g = done.setdefault(r.id, Generation(r.id))
                g.tokens += r.tokens
                g.cached_tokens = max(g.cached_tokens, r.cached_tokens)
                if r.finished:
                    g.finished, g.error = r.finished, r.error
        raise RuntimeError(f"moelink: Engine.run: not idle after {max_steps} steps")

    def take_kv_events(self):
        """(cleared_all, [(kind, hashes, parent)]): what the prefix cache
        changed since the last call, in moelink block hashes (the
        scheduler's KvEvents: kind "stored" with its parent, or "removed")."""
        return self._impl.take_kv_events()

    @property
    def running(self) -> int:
        return self._impl.running

    @property
    def waiting(self) -> int:
        return self._impl.waiting

    @property
    def idle(self) -> bool:
        return self._impl.idle

    @property
    def failure(self) -> str:
        """"" while the engine serves; else why its model cannot run again
        (a CUDA error, a peer rank gone): that step ended every request
        with finished "error", and add() now raises moelink.SystemError.
        (Bad batch values end only their step's requests.)"""
        return self._impl.failure

    @property
    def preemptions(self) -> int:
        return self._impl.preemptions

    @property
    def drafts_proposed(self) -> int:
        """Drafts sent for verification so far (speculative)."""
        return self._impl.drafts_proposed

    @property
    def drafts_accepted(self) -> int:
        return self._impl.drafts_accepted

    @property
    def available_pages(self) -> int:
        return self._impl.available_pages

    @property
    def cached_pages(self) -> int:
        return self._impl.cached_pages

    @property
    def step_times(self) -> dict:
        """The model's steps inside step() so far: steps and seconds, and
        the decode-only ones (every request decoding): decode_steps,
        decode_seconds, decode_requests (host clock around the model's
        step, which waits for the device); and of step() itself:
        step_seconds (its C++ part, without the GIL) and gil_wait_seconds
        (the wait to take the GIL back after it)."""
        return self._impl.step_times
