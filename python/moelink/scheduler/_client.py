"""Submitting requests to moelink-scheduler: a blocking client and an asyncio
one (grpc.aio). The C++ twin is moelink::scheduler::SchedulerClient.

    client = SchedulerClient("127.0.0.1:50051")
    result = client.complete(prompt_tokens=ids, max_new_tokens=128, session_id="chat-7")
    for event in client.generate(text="...", tokenizer=tok, max_new_tokens=64):
        ...  # pb.GenerateEvent: accepted, tokens, finished (or redirect)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, List, Optional, Sequence

import grpc

from ._engine_client import CHANNEL_OPTIONS
from .v1 import scheduler_pb2 as pb
from .v1 import scheduler_pb2_grpc as pb_grpc


class SchedulerError(RuntimeError):
    """A request's stream ended with a non-OK status (see the proto's list)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass
class Completion:
    request_id: str = ""
    engine_id: str = ""
    tokens: List[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str = ""
    redirect: Optional[pb.Redirect] = None


def make_request(prompt_tokens: Optional[Sequence[int]] = None, *, text: Optional[str] = None,
                 tokenizer=None, max_new_tokens: int = 128, session_id: str = "",
                 request_id: str = "", redirect: bool = False, stream_interval: int = 0,
                 ignore_eos: bool = False, temperature: float = 0.0) -> pb.GenerateRequest:
    """A GenerateRequest from token ids, or from text and a tokenizer (an
    object with encode(text) -> ids, e.g. a Hugging Face tokenizer, or a
    callable)."""
    if (prompt_tokens is None) == (text is None):
        raise ValueError("give exactly one of prompt_tokens and text")
    if text is not None:
        if tokenizer is None:
            raise ValueError("text needs a tokenizer (the client applies it)")
        prompt_tokens = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)
    return pb.GenerateRequest(
        request_id=request_id, prompt_tokens=list(prompt_tokens), session_id=session_id,
        redirect=redirect, stream_interval=stream_interval,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                   temperature=temperature))


def _fold(events, out: Completion) -> None:
    for ev in events:
        kind = ev.WhichOneof("kind")
        if kind == "accepted":
            out.request_id, out.engine_id = ev.accepted.request_id, ev.accepted.engine_id
        elif kind == "tokens":
            del out.tokens[ev.tokens.offset:]
            out.tokens.extend(ev.tokens.token_ids)
        elif kind == "finished":
            out.finish_reason, out.cached_tokens = ev.finished.finish_reason, ev.finished.cached_tokens
            out.engine_id = ev.finished.engine_id or out.engine_id
        elif kind == "redirect":
            out.redirect, out.request_id = ev.redirect, ev.redirect.request_id
            out.engine_id = ev.redirect.engine_id


def _channel(target: str, credentials, aio: bool):
    mod = grpc.aio if aio else grpc
    if credentials is None:
        return mod.insecure_channel(target, options=CHANNEL_OPTIONS)
    return mod.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


class SchedulerClient:
    def __init__(self, target: str, credentials: Optional[grpc.ChannelCredentials] = None):
        self._channel = _channel(target, credentials, aio=False)
        self._stub = pb_grpc.FrontendStub(self._channel)

    def generate(self, prompt_tokens: Optional[Sequence[int]] = None, *,
                 timeout: Optional[float] = None, **kw) -> Iterator[pb.GenerateEvent]:
        """The request's events; raises SchedulerError when it fails."""
        req = kw.pop("request") if "request" in kw else make_request(prompt_tokens, **kw)
        try:
            yield from self._stub.Generate(req, timeout=timeout)
        except grpc.RpcError as e:
            raise SchedulerError(e.code(), e.details() or "") from None

    def complete(self, prompt_tokens: Optional[Sequence[int]] = None, **kw) -> Completion:
        """Runs a request to the end and returns its output."""
        out = Completion()
        _fold(self.generate(prompt_tokens, **kw), out)
        return out

    def resume(self, request_id: str, from_token: int = 0,
               timeout: Optional[float] = None) -> Iterator[pb.GenerateEvent]:
        try:
            yield from self._stub.Resume(pb.ResumeRequest(request_id=request_id, from_token=from_token),
                                         timeout=timeout)
        except grpc.RpcError as e:
            raise SchedulerError(e.code(), e.details() or "") from None

    def cancel(self, request_id: str) -> None:
        try:
            self._stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=5)
        except grpc.RpcError as e:
            raise SchedulerError(e.code(), e.details() or "") from None

    def stats(self) -> pb.Stats:
        return self._stub.GetStats(pb.StatsRequest(), timeout=5)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SchedulerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSchedulerClient:
    """The same on asyncio (grpc.aio), for clients with many requests in flight."""

    def __init__(self, target: str, credentials: Optional[grpc.ChannelCredentials] = None):
        self._channel = _channel(target, credentials, aio=True)
        self._stub = pb_grpc.FrontendStub(self._channel)

    async def generate(self, prompt_tokens: Optional[Sequence[int]] = None, *,
                       timeout: Optional[float] = None, **kw) -> AsyncIterator[pb.GenerateEvent]:
        req = kw.pop("request") if "request" in kw else make_request(prompt_tokens, **kw)
        try:
            async for ev in self._stub.Generate(req, timeout=timeout):
                yield ev
        except grpc.RpcError as e:
            raise SchedulerError(e.code(), e.details() or "") from None

    async def complete(self, prompt_tokens: Optional[Sequence[int]] = None, **kw) -> Completion:
        out = Completion()
        events = [ev async for ev in self.generate(prompt_tokens, **kw)]
        _fold(events, out)
        return out

    async def stats(self) -> pb.Stats:
        return await self._stub.GetStats(pb.StatsRequest(), timeout=5)

    async def close(self) -> None:
        await self._channel.close()
