"""moelink.scheduler: clients of moelink-scheduler, the KV-cache-aware request
scheduler (docs/scheduler.md; contract: proto/moelink/scheduler/v1/scheduler.proto).

  EngineClient          for engines: register, receive requests, report load,
                        KV-cache events and progress
  SchedulerClient       for submitters (blocking); AsyncSchedulerClient (asyncio)
  prompt_block_hashes   moelink block hash v1, as the scheduler computes it
  CodepointTokenizer    a reversible toy tokenizer (tests, benchmarks)
  pb                    the protocol's messages (scheduler_pb2)

Needs grpcio, protobuf and xxhash (pip install moelink[scheduler])."""

from __future__ import annotations

try:
    from .v1 import scheduler_pb2 as pb
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "moelink.scheduler needs the code generated from scheduler.proto and the grpcio and "
        "protobuf packages: pip install grpcio protobuf, and build moelink with grpcio-tools "
        f"installed ({e})") from e

from ._block_hash import ROOT_BLOCK_HASH, block_hash, prompt_block_hashes
from ._client import AsyncSchedulerClient, Completion, SchedulerClient, SchedulerError, make_request
from ._engine_client import (
    FAILED,
    FINISHED,
    HANDED_OFF,
    REJECTED,
    RUNNING,
    STARTED,
    EngineClient,
    ReportResult,
    cleared_event,
    load,
    progress,
    removed_event,
    stored_event,
)
from ._tokenizer import CodepointTokenizer

__all__ = [
    "AsyncSchedulerClient", "CodepointTokenizer", "Completion", "EngineClient", "FAILED",
    "FINISHED", "HANDED_OFF", "REJECTED", "ROOT_BLOCK_HASH", "RUNNING", "ReportResult", "STARTED",
    "SchedulerClient", "SchedulerError", "block_hash", "cleared_event", "load", "make_request",
    "pb", "progress", "prompt_block_hashes", "removed_event", "stored_event",
]
