"""The engine side of the scheduler protocol, for Python engines (vLLM,
SGLang, in-house): register, receive the requests routed here, report load,
KV-cache events and each request's progress. The C++ twin is
moelink::scheduler::EngineClient (include/moelink/scheduler/engine_client.h).

    client = EngineClient("127.0.0.1:50051", "engine-0", kv_capacity_blocks=8192,
                          block_size=16, max_batch=64, on_run=queue.put)
    client.start()
    # each engine step: STARTED for the requests it is about to prefill (and
    # wait for the ack), the output tokens since the last report, KV events.
    result = client.report(load=load(running=.., waiting=..),
                           progress=[progress(rid, STARTED, cached_tokens=..)],
                           kv_events=[stored_event(hashes, parent)])
    if rid in result.revoked: drop it, do not start it

The client re-registers by itself when its assignment stream breaks or the
scheduler fenced it (a report refused), passing what `held()` returns, and
sends heartbeats (with `load()`) between reports.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence

import grpc

from .v1 import scheduler_pb2 as pb
from .v1 import scheduler_pb2_grpc as pb_grpc

STARTED = pb.RequestProgress.STARTED
RUNNING = pb.RequestProgress.RUNNING
FINISHED = pb.RequestProgress.FINISHED
FAILED = pb.RequestProgress.FAILED
REJECTED = pb.RequestProgress.REJECTED
HANDED_OFF = pb.RequestProgress.HANDED_OFF
ROLES = {"mixed": pb.ROLE_MIXED, "prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}

_MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    # gRPC's default reconnect backoff grows to 120 s (calls fail at once
    # meanwhile): after a scheduler restart, come back within a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def load(running: int = 0, waiting: int = 0, free_kv_blocks: int = 0,
         waiting_prefill_tokens: int = 0, active_tokens: int = 0) -> pb.EngineLoad:
    """An EngineLoad: requests decoding and waiting, free KV blocks, uncached
    prompt tokens waiting for prefill, prompt + output tokens of unfinished
    requests."""
    return pb.EngineLoad(running=running, waiting=waiting, free_kv_blocks=free_kv_blocks,
                         waiting_prefill_tokens=waiting_prefill_tokens, active_tokens=active_tokens)


def stored_event(block_hashes: Sequence[int], parent: Optional[int] = None,
                 token_ids: Sequence[int] = ()) -> pb.KvEvent:
    """Blocks stored, in chain order; `parent` is the block before the first
    (None for a prompt's first block). With token_ids the hashes may be the
    engine's own; without, they must be moelink block hashes."""
    st = pb.BlocksStored(block_hashes=list(block_hashes), token_ids=list(token_ids))
    if parent is not None:
        st.parent_block_hash = parent
    return pb.KvEvent(stored=st)


def removed_event(block_hashes: Sequence[int]) -> pb.KvEvent:
    return pb.KvEvent(removed=pb.BlocksRemoved(block_hashes=list(block_hashes)))


def cleared_event() -> pb.KvEvent:
    return pb.KvEvent(cleared=pb.AllBlocksCleared())


def progress(request_id: str, phase: int, new_tokens: Sequence[int] = (), token_offset: int = 0,
             cached_tokens: int = 0, finish_reason: str = "", handed_to: str = "") -> pb.RequestProgress:
    return pb.RequestProgress(request_id=request_id, phase=phase, new_tokens=list(new_tokens),
                              token_offset=token_offset, cached_tokens=cached_tokens,
                              finish_reason=finish_reason, handed_to=handed_to)


@dataclass
class ReportResult:
    ok: bool
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    revoked: List[str] = field(default_factory=list)  # drop these; never start them


class EngineClient:
    def __init__(self, target: str, engine_id: str, *, kv_capacity_blocks: int, block_size: int,
                 max_batch: int, on_run: Callable[[pb.RunRequest], None],
                 on_cancel: Optional[Callable[[pb.CancelRun], None]] = None,
                 held: Optional[Callable[[], Iterable[pb.HeldRequest]]] = None,
                 on_released: Optional[Callable[[List[str]], None]] = None,
                 load: Optional[Callable[[], pb.EngineLoad]] = None,
                 dp_rank: int = 0, address: str = "", prefill_us_per_token: float = 0.0,
                 decode_step_us: float = 0.0, role: str = "mixed", handoff_address: str = "",
                 engine_token: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 rpc_timeout: float = 5.0, max_backoff: float = 1.0):
        self.info = pb.EngineInfo(engine_id=engine_id, dp_rank=dp_rank,
                                  kv_capacity_blocks=kv_capacity_blocks, block_size=block_size,
                                  max_batch=max_batch, address=address,
                                  prefill_us_per_token=prefill_us_per_token,
                                  decode_step_us=decode_step_us, role=ROLES[role],
                                  handoff_address=handoff_address)
        self._on_run, self._on_cancel = on_run, on_cancel
        self._held, self._on_released, self._load = held, on_released, load
        self._metadata = (("authorization", f"Bearer {engine_token}"),) if engine_token else ()
        self._timeout, self._max_backoff = rpc_timeout, max_backoff
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.EngineGatewayStub(self._channel)
        self._cv = threading.Condition()
        self._stopping = False
        self._connected = False
        self._incarnation = 0
        self._heartbeat_ms = 500
        self._last_error = "not connected yet"
        self._stream = None
        self._report_lock = threading.Lock()
        self._seq = 0
        self._seq_incarnation = 0
        self._last_report = 0.0
        self._threads: List[threading.Thread] = []

    # ---------------------------------------------------------------- session
    @property
    def incarnation(self) -> int:
        with self._cv:
            return self._incarnation

    @property
    def connected(self) -> bool:
        with self._cv:
            return self._connected

    def start(self, timeout: float = 10.0) -> "EngineClient":
        """Registers and opens the assignment stream; raises RuntimeError with
        the scheduler's last answer if that takes longer than `timeout` s."""
        for fn in (self._session_loop, self._heartbeat_loop):
            t = threading.Thread(target=fn, daemon=True, name=f"moelink-{self.info.engine_id}")
            t.start()
            self._threads.append(t)
        with self._cv:
            if not self._cv.wait_for(lambda: self._connected, timeout):
                raise RuntimeError(f"engine '{self.info.engine_id}' could not register within "
                                   f"{timeout} s: {self._last_error}")
        return self

    def _register(self) -> bool:
        req = pb.RegisterRequest(engine=self.info, held=list(self._held()) if self._held else [])
        try:
            resp = self._stub.Register(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            with self._cv:
                self._last_error = f"Register: {e.code().name}: {e.details()}"
            return False
        if resp.released and self._on_released:
            self._on_released(list(resp.released))
        with self._cv:
            self._incarnation = resp.incarnation
            self._heartbeat_ms = resp.heartbeat_interval_ms or 500
        return True

    def _read_stream(self) -> None:
        with self._cv:
            if self._stopping:
                return
            call = self._stub.ReceiveAssignments(
                pb.ReceiveAssignmentsRequest(engine_id=self.info.engine_id,
                                             incarnation=self._incarnation),
                metadata=self._metadata)
            self._stream = call
        try:
            for a in call:
                if a.HasField("run"):
                    self._on_run(a.run)
                elif a.HasField("cancel") and self._on_cancel:
                    self._on_cancel(a.cancel)
            why = "assignment stream ended"
        except grpc.RpcError as e:
            why = f"assignment stream: {e.code().name}: {e.details()}"
        with self._cv:
            self._connected = False
            self._stream = None
            self._last_error = why

    def _session_loop(self) -> None:
        backoff = 0.05
        while True:
            with self._cv:
                if self._stopping:
                    return
            if self._register():
                backoff = 0.05
                with self._cv:
                    self._connected = True
                    self._cv.notify_all()
                self._read_stream()
            with self._cv:
                self._cv.wait_for(lambda: self._stopping, backoff)
            backoff = min(backoff * 2, self._max_backoff)

    def _heartbeat_loop(self) -> None:
        while True:
            with self._cv:
                period = max(0.001, self._heartbeat_ms / 2000.0)
                self._cv.wait_for(lambda: self._stopping, period)
                if self._stopping:
                    return
                if not self._connected:
                    continue
            with self._report_lock:
                due = time.monotonic() - self._last_report >= period
            if due:
                self.report(load=self._load() if self._load else None)

    def _reconnect(self) -> None:
        with self._cv:
            self._connected = False
            if self._stream is not None:
                self._stream.cancel()

    # ---------------------------------------------------------------- calls
    def report(self, load: Optional[pb.EngineLoad] = None, kv_events: Iterable[pb.KvEvent] = (),
               progress: Iterable[pb.RequestProgress] = ()) -> ReportResult:
        """One report. Thread-safe; the client numbers them. A refusal because
        the scheduler fenced this engine makes it register again."""
        req = pb.EngineReport(engine_id=self.info.engine_id, load=load or pb.EngineLoad(),
                              kv_events=list(kv_events), progress=list(progress))
        with self._report_lock:
            inc = self.incarnation
            if inc != self._seq_incarnation:
                self._seq_incarnation, self._seq = inc, 0
            self._seq += 1
            req.incarnation, req.seq = inc, self._seq
            try:
                resp = self._stub.Report(req, timeout=self._timeout, metadata=self._metadata)
                result = ReportResult(True, revoked=list(resp.revoked))
            except grpc.RpcError as e:
                result = ReportResult(False, e.code(), e.details() or "")
            self._last_report = time.monotonic()
        if result.ok and result.revoked and self._on_released:
            self._on_released(result.revoked)
        if result.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
            self._reconnect()
        return result

    def leave(self, drain: bool = False) -> None:
        """Leaves the pool; with drain, finishes what it holds first (keep
        reporting until then). Raises grpc.RpcError if the scheduler refuses."""
        try:
            self._stub.Leave(pb.LeaveRequest(engine_id=self.info.engine_id,
                                             incarnation=self.incarnation, drain=drain),
                             timeout=self._timeout, metadata=self._metadata)
        finally:
            if not drain:
                self.close()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            if self._stream is not None:
                self._stream.cancel()
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._channel.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
