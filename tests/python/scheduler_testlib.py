"""What the scheduler's multi-process tests share: the module-level skip
when moelink.scheduler or its binaries are missing, the simulator's
deterministic output, and small GetStats / polling helpers.

Import it before anything from moelink.scheduler: on a machine without
grpcio, protobuf, xxhash or the built binaries it skips the importing test
module, saying why."""

from __future__ import annotations

import time

import pytest

try:
    import grpc

    from moelink.scheduler import ROOT_BLOCK_HASH, SchedulerClient, block_hash
    from moelink.scheduler._block_hash import splitmix64
    from moelink.scheduler.local_cluster import find_binary
except ImportError as e:  # grpcio / protobuf / xxhash, or the generated code, missing
    pytest.skip(f"moelink.scheduler is not importable (needs grpcio, protobuf, xxhash and the code "
                f"generated from scheduler.proto; set MOELINK_PYTHONPATH to a build's python dir): {e}",
                allow_module_level=True)

SCHEDULER_BIN = find_binary("moelink-scheduler")
SIM_BIN = find_binary("moelink-engine-sim")
if not SCHEDULER_BIN or not SIM_BIN:
    pytest.skip("moelink-scheduler / moelink-engine-sim not found: build tools/scheduler and set "
                "MOELINK_BIN_DIR (e.g. build-sched/tools/scheduler)", allow_module_level=True)

BLOCK = 16  # LocalCluster's default block size
MASK64 = (1 << 64) - 1


def sim_tokens(prompt, n):
    """moelink-engine-sim's deterministic output: token i = 1000 +
    splitmix64(prompt_hash + i) % 30000, prompt_hash = block_hash(ROOT, prompt)."""
    h = block_hash(ROOT_BLOCK_HASH, list(prompt))
    return [1000 + splitmix64((h + i) & MASK64) % 30000 for i in range(n)]


def rand_tokens(rng, n):
    return [rng.randrange(0, 30000) for _ in range(n)]


def stats(target):
    with SchedulerClient(target) as c:
        return c.stats()


def engine_stats(target, engine_id):
    """The engine's GetStats entry, or None when the scheduler lists none."""
    for e in stats(target).engines:
        if e.engine_id == engine_id:
            return e
    return None


def wait_for(pred, timeout, what):
    """Polls pred() until it is truthy (an RpcError counts as not yet: the
    scheduler may be restarting); AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except grpc.RpcError as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last})")
