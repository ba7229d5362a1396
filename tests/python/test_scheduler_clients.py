"""moelink.scheduler's Python clients against a real moelink-scheduler process:
the block hash (pinned, shared with the C++ tests), the toy tokenizer,
make_request, a Python EngineClient engine (register, receive, report
STARTED / tokens / FINISHED, publish KV events), engine authentication and
the scheduler's refusal to listen beyond loopback unauthenticated.

Every scheduler here is a separate process on 127.0.0.1 (LocalCluster with no
simulated engines); the engines are Python EngineClients in this process.

    MOELINK_PYTHONPATH=build-sched/python MOELINK_BIN_DIR=build-sched/tools/scheduler \
        python3 -m pytest -q tests/python/test_scheduler_clients.py
"""

from __future__ import annotations

import os
import queue
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from scheduler_testlib import (  # noqa: I001 - first: skips this module when the scheduler is missing
    BLOCK,
    SCHEDULER_BIN,
    SIM_BIN,
    engine_stats,
    rand_tokens,
    sim_tokens,
    stats,
    wait_for,
)

import grpc  # noqa: E402

from moelink.scheduler import (  # noqa: E402
    FINISHED,
    REJECTED,
    ROOT_BLOCK_HASH,
    RUNNING,
    STARTED,
    CodepointTokenizer,
    EngineClient,
    SchedulerClient,
    SchedulerError,
    block_hash,
    cleared_event,
    load,
    make_request,
    pb,
    progress,
    prompt_block_hashes,
    removed_event,
    stored_event,
)
from moelink.scheduler.local_cluster import LocalCluster  # noqa: E402
from moelink.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# The pinned values of tests/scheduler/test_block_hash_and_index.cc (BlockHash.PinnedValues).
PINNED_TOKENS = [i * 7 + 3 for i in range(40)]
PINNED_BLOCKS = [0x841266545BFE497B, 0xF99BAFCC168BF13A]
PINNED_ONE = 0xECA23B8EE35431B7  # block_hash(ROOT_BLOCK_HASH, [42])


# ---------------------------------------------------------------------- helpers


class PyEngine:
    """A minimal Python engine on EngineClient. With auto, a worker serves each
    RunRequest as the protocol asks: STARTED (and waits for its
    acknowledgement), the output in two reports, FINISHED. The output is the
    simulator's, so sim_tokens() checks it."""

    def __init__(self, target, engine_id, *, auto=True, token=None, block_size=BLOCK,
                 kv_blocks=4096, max_batch=8, held=None):
        self.id = engine_id
        self.runs: "queue.Queue[pb.RunRequest]" = queue.Queue()
        self.cancels: "queue.Queue[pb.CancelRun]" = queue.Queue()
        self.released = []
        self.served = []    # request ids run to FINISHED
        self.refused = []   # request ids whose STARTED was not acknowledged
        self.errors = []
        self.auto = auto
        self.client = EngineClient(target, engine_id, kv_capacity_blocks=kv_blocks,
                                   block_size=block_size, max_batch=max_batch,
                                   on_run=self.runs.put, on_cancel=self.cancels.put,
                                   on_released=self.released.extend, held=held,
                                   engine_token=token, rpc_timeout=5.0)
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._loop, daemon=True, name=f"py-engine-{engine_id}")

    def start(self, timeout=10.0):
        self.client.start(timeout)
        if self.auto:
            self._worker.start()
        # start() returns once Register answered; the assignment stream
        # attaches right after (only then does the scheduler route here).
        time.sleep(0.25)
        return self

    def _loop(self):
        while not self._stop.is_set():
            try:
                run = self.runs.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                self.serve(run)
            except Exception as e:  # noqa: BLE001 - reported by the tests
                self.errors.append(repr(e))

    def serve(self, run):
        rid = run.request_id
        r = self.client.report(progress=[progress(rid, STARTED, cached_tokens=run.expected_cached_tokens)])
        if not r.ok or rid in r.revoked:
            self.refused.append(rid)
            return False
        toks = sim_tokens(run.prompt_tokens, run.sampling.max_new_tokens)
        half = len(toks) // 2
        r = self.client.report(progress=[progress(rid, RUNNING, toks[:half], 0)])
        if not r.ok:
            self.errors.append(f"{rid}: RUNNING refused: {r.code} {r.details}")
        r = self.client.report(progress=[progress(rid, FINISHED, toks[half:], half, finish_reason="length")])
        if not r.ok:
            self.errors.append(f"{rid}: FINISHED refused: {r.code} {r.details}")
        self.served.append(rid)
        return True

    def close(self):
        self._stop.set()
        self.client.close()



def test_a_bare_scheduler_needs_no_simulator(tmp_path):
    """moelink-serve --engines N starts the scheduler with no simulated
    engines: a directory holding moelink-scheduler alone suffices (the
    device carries no simulator); asking for simulated engines there names
    the missing binary."""
    found = LocalCluster(engines=0).scheduler_bin
    (tmp_path / "moelink-scheduler").symlink_to(os.path.abspath(found))
    env = {k: os.environ.pop(k) for k in ("MOELINK_BIN_DIR", "PATH") if k in os.environ}
    try:
        with LocalCluster(engines=0, bin_dir=str(tmp_path)) as c:
            assert c.sim_bin is None and c.port > 0
        with pytest.raises(FileNotFoundError, match="moelink-engine-sim not found"):
            LocalCluster(engines=2, bin_dir=str(tmp_path))
    finally:
        os.environ.update(env)

@pytest.fixture
def cluster():
    """A bare scheduler (no simulated engines); provisional entries live 1 ms,
    so routing follows the engines' KV events only. Its log is printed at
    teardown (pytest shows it for a failed test); it must exit cleanly."""
    with LocalCluster(engines=0, scheduler_args=["--provisional-ttl-ms", "1"]) as c:
        yield c
        print(c.logs())
        c.stop()
        assert c.scheduler_proc.returncode == 0, f"moelink-scheduler exited with {c.scheduler_proc.returncode}"


def events_of(target, req, timeout=15.0):
    """(events, error) of one Generate call."""
    out = []
    try:
        with SchedulerClient(target) as c:
            for ev in c.generate(request=req, timeout=timeout):
                out.append(ev)
    except SchedulerError as e:
        return out, e
    return out, None


def generate_in_background(target, req, out):
    """One Generate call on a thread; out["events"], out["error"] once it ends."""
    t = threading.Thread(target=lambda: out.update(zip(("events", "error"), events_of(target, req))))
    t.start()
    return t


def tokens_in_order(events):
    """Output tokens of a stream, checking every Tokens event continues the last."""
    toks = []
    for ev in events:
        if ev.HasField("tokens"):
            assert ev.tokens.offset == len(toks), f"Tokens offset {ev.tokens.offset} after {len(toks)} tokens"
            toks.extend(ev.tokens.token_ids)
    return toks


def accepted_of(events):
    acc = [ev.accepted for ev in events if ev.HasField("accepted")]
    assert acc, f"no Accepted in {events}"
    return acc[-1]


# ---------------------------------------------------------------------- block hash


def test_block_hash_pinned_values_match_the_cpp_test():
    assert prompt_block_hashes(PINNED_TOKENS, 16) == PINNED_BLOCKS
    assert block_hash(ROOT_BLOCK_HASH, [42]) == PINNED_ONE
    assert ROOT_BLOCK_HASH == 0x6D6F656C696E6B31
    # The C++ test pins the very same literals (so neither side drifts alone).
    cpp = (REPO / "tests/scheduler/test_block_hash_and_index.cc").read_text()
    test = re.search(r"TEST\(BlockHash, PinnedValues\)(.*?)\n}\n", cpp, re.S)
    assert test, "BlockHash.PinnedValues not found in test_block_hash_and_index.cc"
    pinned = [int(v, 16) for v in re.findall(r"0x([0-9a-fA-F]{16})ull", test.group(1))]
    assert pinned == PINNED_BLOCKS + [PINNED_ONE], [hex(v) for v in pinned]
    assert "i * 7 + 3" in cpp and "i < 40" in cpp


def test_block_hash_chains_the_prefix():
    rng = random.Random(7)
    a = rand_tokens(rng, 100)  # 6 full blocks and a partial one
    ha = prompt_block_hashes(a, 16)
    assert len(ha) == 6
    assert prompt_block_hashes(a[:96], 16) == ha          # the partial block has no hash
    assert prompt_block_hashes(a[:40], 16) == ha[:2]
    assert ha[0] == block_hash(ROOT_BLOCK_HASH, a[:16])
    assert ha[1] == block_hash(ha[0], a[16:32])
    b = list(a)
    b[50] ^= 1                                            # block 3 differs
    hb = prompt_block_hashes(b, 16)
    assert hb[:3] == ha[:3] and all(x != y for x, y in zip(hb[3:], ha[3:]))
    assert prompt_block_hashes(a, 32) == [block_hash(ROOT_BLOCK_HASH, a[:32]),
                                          block_hash(block_hash(ROOT_BLOCK_HASH, a[:32]), a[32:64]),
                                          block_hash(block_hash(block_hash(ROOT_BLOCK_HASH, a[:32]), a[32:64]),
                                                     a[64:96])]
    assert prompt_block_hashes([], 16) == []
    assert prompt_block_hashes(range(15), 16) == []
    with pytest.raises(ValueError, match="block_size 0"):
        prompt_block_hashes(a, 0)
    # Full 32-bit token ids hash like any other.
    assert prompt_block_hashes([0xFFFFFFFF] * 16, 16) != prompt_block_hashes([0] * 16, 16)


# ---------------------------------------------------------------------- tokenizer


def test_codepoint_tokenizer_round_trip():
    tok = CodepointTokenizer()
    rng = random.Random(11)
    max_id = 0x10FFFF - 0x800 - 0x100
    edges = [0, 1, 0xD6FF, 0xD700, 0xD701, 0xDEFF, 0xDF00, 0xFFFF, 0x10000, max_id - 1, max_id]
    ids = edges + [rng.randrange(0, 0xD700) for _ in range(500)] + \
        [rng.randrange(0xD700, max_id + 1) for _ in range(500)]  # past the surrogate gap
    rng.shuffle(ids)
    text = tok.decode(ids)
    assert len(text) == len(ids)
    assert tok.encode(text) == ids
    assert all(not 0xD800 <= ord(ch) < 0xE000 for ch in text)  # no surrogates in the text
    assert all(ord(ch) >= 0x100 for ch in text)
    assert tok.decode([0]) == "\u0100"
    assert tok.decode([0xD6FF]) == "\ud7ff"
    assert tok.decode([0xD700]) == "\ue000"              # the first id past the gap
    assert tok.decode([max_id]) == "\U0010ffff"
    assert tok.encode("\ue000\ud7ff") == [0xD700, 0xD6FF]
    # The text survives UTF-8 (what moelink-engine-sim's HTTP front end reads).
    assert tok.encode(text.encode("utf-8").decode("utf-8")) == ids
    assert tok.decode([]) == "" and tok.encode("") == []


def test_codepoint_tokenizer_errors():
    tok = CodepointTokenizer()
    for ch in ("a", "\x00", " ", "\n", "\u00ff", "\u00e9"):
        with pytest.raises(ValueError, match=f"U\\+{ord(ch):04X}.*encodes no token"):
            tok.encode("\u0100" + ch)
    too_big = 0x10FFFF - 0x800 - 0x100 + 1
    with pytest.raises(ValueError, match=f"token id {too_big} has no code point"):
        tok.decode([5, too_big])


def test_codepoint_tokenizer_refuses_surrogates():
    tok = CodepointTokenizer()
    with pytest.raises(ValueError):
        tok.encode("\ud800")


# ---------------------------------------------------------------------- make_request


def test_make_request_errors_and_text_path():
    with pytest.raises(ValueError, match="exactly one of prompt_tokens and text"):
        make_request()
    with pytest.raises(ValueError, match="exactly one of prompt_tokens and text"):
        make_request([1, 2], text="\u0101")
    with pytest.raises(ValueError, match="text needs a tokenizer"):
        make_request(text="\u0101\u0102")
    tok = CodepointTokenizer()
    r = make_request(text="\u0100\u0101\ue000", tokenizer=tok, max_new_tokens=7, session_id="s-1",
                     request_id="rid-1", redirect=True, stream_interval=4, ignore_eos=True,
                     temperature=0.5)
    assert isinstance(r, pb.GenerateRequest)
    assert list(r.prompt_tokens) == [0, 1, 0xD700]
    assert (r.sampling.max_new_tokens, r.sampling.ignore_eos, r.sampling.temperature) == (7, True, 0.5)
    assert (r.session_id, r.request_id, r.redirect, r.stream_interval) == ("s-1", "rid-1", True, 4)
    # A callable tokenizer (no encode method) works too.
    r = make_request(text="abc", tokenizer=lambda s: [ord(c) for c in s])
    assert list(r.prompt_tokens) == [97, 98, 99]
    assert r.sampling.max_new_tokens == 128 and r.request_id == "" and not r.redirect
    # Token ids as given, from any iterable.
    assert list(make_request(range(3), max_new_tokens=1).prompt_tokens) == [0, 1, 2]
    # The tokenizer's errors reach the caller.
    with pytest.raises(ValueError, match="encodes no token"):
        make_request(text="ascii", tokenizer=tok)


# ---------------------------------------------------------------------- a Python engine


def test_python_engine_serves_a_request(cluster):
    """Register, receive the RunRequest, STARTED (acknowledged), tokens (one
    report retried with an overlap), FINISHED; the client sees exactly those
    tokens, once each."""
    eng = PyEngine(cluster.target, "py-0", auto=False).start()
    try:
        assert eng.client.connected and eng.client.incarnation > 0
        e = engine_stats(cluster.target, "py-0")
        assert e.alive and e.incarnation == eng.client.incarnation and e.indexed_blocks == 0

        rng = random.Random(1)
        tok = CodepointTokenizer()
        prompt = rand_tokens(rng, 53)
        out = {}
        req = make_request(text=tok.decode(prompt), tokenizer=tok, max_new_tokens=6, request_id="py-req-1")
        t = generate_in_background(cluster.target, req, out)
        run = eng.runs.get(timeout=10)
        assert run.request_id == "py-req-1"
        assert list(run.prompt_tokens) == prompt
        assert run.sampling.max_new_tokens == 6
        assert run.expected_cached_tokens == 0

        want = sim_tokens(prompt, 6)
        r = eng.client.report(load=load(running=0, waiting=1, free_kv_blocks=4000),
                              progress=[progress("py-req-1", STARTED, cached_tokens=0)])
        assert r.ok and r.revoked == [], (r.code, r.details)  # the acknowledgement: start now
        r = eng.client.report(load=load(running=1), progress=[progress("py-req-1", RUNNING, want[:2], 0)])
        assert r.ok and r.revoked == []
        # A retried report (its acknowledgement was lost) overlaps: nothing is duplicated.
        r = eng.client.report(progress=[progress("py-req-1", RUNNING, want[1:4], 1)])
        assert r.ok and r.revoked == []
        r = eng.client.report(progress=[progress("py-req-1", FINISHED, want[4:], 4, finish_reason="length")])
        assert r.ok and r.revoked == []
        t.join(15)
        assert not t.is_alive()
        events, error = out["events"], out["error"]
        assert error is None, error
        kinds = [ev.WhichOneof("kind") for ev in events]
        assert kinds[0] == "accepted" and kinds[-1] == "finished" and kinds.count("finished") == 1, kinds
        acc = events[0].accepted
        assert (acc.request_id, acc.engine_id, acc.expected_cached_tokens) == ("py-req-1", "py-0", 0)
        assert tokens_in_order(events) == want
        fin = events[-1].finished
        assert (fin.finish_reason, fin.output_tokens, fin.cached_tokens, fin.engine_id) == ("length", 6, 0, "py-0")

        # The request is no longer the engine's: late progress is revoked, not an error.
        r = eng.client.report(progress=[progress("py-req-1", RUNNING, [1], 6)])
        assert r.ok and r.revoked == ["py-req-1"]
        s = stats(cluster.target)
        assert (s.accepted, s.finished, s.failed, s.requests_in_flight) == (1, 1, 0, 0)
        e = engine_stats(cluster.target, "py-0")
        assert (e.assigned, e.outstanding) == (1, 0)

        # KV events with moelink hashes computed in Python (no token ids).
        hashes = prompt_block_hashes(prompt, BLOCK)
        assert len(hashes) == 3
        r = eng.client.report(kv_events=[stored_event(hashes)])
        assert r.ok, (r.code, r.details)
        assert engine_stats(cluster.target, "py-0").indexed_blocks == 3
        r = eng.client.report(kv_events=[removed_event(hashes[2:])])
        assert r.ok and engine_stats(cluster.target, "py-0").indexed_blocks == 2
        r = eng.client.report(kv_events=[cleared_event()])
        assert r.ok and engine_stats(cluster.target, "py-0").indexed_blocks == 0
    finally:
        eng.close()


def test_python_hashes_route_like_the_scheduler(cluster):
    """Two Python engines; the second publishes a prefix nobody ever sent
    (moelink hashes computed by prompt_block_hashes, no token ids, in two
    chained events): a prompt sharing it goes there, expecting exactly the
    prefix's tokens cached. Only if the Python and C++ hashes agree."""
    a = PyEngine(cluster.target, "py-a").start()
    b = PyEngine(cluster.target, "py-b").start()
    try:
        rng = random.Random(2)
        q = rand_tokens(rng, 160)  # 10 blocks
        h = prompt_block_hashes(q, BLOCK)
        r = b.client.report(kv_events=[stored_event(h[:4]), stored_event(h[4:], parent=h[3])])
        assert r.ok, (r.code, r.details)
        assert engine_stats(cluster.target, "py-b").indexed_blocks == 10
        # a publishes another prefix.
        q2 = rand_tokens(rng, 64)
        assert a.client.report(kv_events=[stored_event(prompt_block_hashes(q2, BLOCK))]).ok

        with SchedulerClient(cluster.target) as c:
            for i, (prompt, engine, cached) in enumerate([
                    (q + rand_tokens(rng, 7), "py-b", 160),
                    (q + rand_tokens(rng, 40), "py-b", 160),
                    (q[:100] + rand_tokens(rng, 30), "py-b", 96),   # 6 full blocks shared
                    (q2 + [1, 2, 3], "py-a", 64),
                    (q2[:16] + q[16:64], "py-a", 16)]):            # the chain breaks after block 0
                events = list(c.generate(prompt, max_new_tokens=3, request_id=f"route-{i}", timeout=15))
                acc = accepted_of(events)
                assert (acc.engine_id, acc.expected_cached_tokens) == (engine, cached), (i, acc)
                assert events[-1].finished.cached_tokens == cached  # what the engine reported
                assert tokens_in_order(events) == sim_tokens(prompt, 3)
        assert a.errors == [] and b.errors == []
    finally:
        a.close()
        b.close()


def test_events_with_token_ids_and_engine_own_hashes(cluster):
    """vLLM-style events: the engine's own block hashes plus the token ids; the
    scheduler computes moelink hashes from the tokens and maps the engine's
    hashes for later parents and removals."""
    a = PyEngine(cluster.target, "py-a").start()
    b = PyEngine(cluster.target, "py-b").start()
    try:
        rng = random.Random(3)
        r_tokens = rand_tokens(rng, 120)               # 7 full blocks + 8 tokens
        own = [rng.getrandbits(64) for _ in range(7)]  # b's own names for them
        res = b.client.report(kv_events=[
            stored_event(own[:4], token_ids=r_tokens[:64]),
            stored_event(own[4:], parent=own[3], token_ids=r_tokens[64:112])])
        assert res.ok, (res.code, res.details)
        assert engine_stats(cluster.target, "py-b").indexed_blocks == 7

        def route(prompt, rid):
            with SchedulerClient(cluster.target) as c:
                events = list(c.generate(prompt, max_new_tokens=2, request_id=rid, timeout=15))
            assert tokens_in_order(events) == sim_tokens(prompt, 2)
            return accepted_of(events)

        acc = route(r_tokens + [7, 7], "own-0")
        assert (acc.engine_id, acc.expected_cached_tokens) == ("py-b", 112)
        # A parent named by the engine's hash, in a later report.
        more = rand_tokens(rng, 32)
        res = b.client.report(kv_events=[stored_event([rng.getrandbits(64), rng.getrandbits(64)],
                                                      parent=own[6], token_ids=more)])
        assert res.ok, (res.code, res.details)
        acc = route(r_tokens[:112] + more + [1], "own-1")
        assert (acc.engine_id, acc.expected_cached_tokens) == ("py-b", 144)
        # Removal by the engine's hash: block 4 goes, the match stops before it.
        assert b.client.report(kv_events=[removed_event([own[4]])]).ok
        assert engine_stats(cluster.target, "py-b").indexed_blocks == 8
        acc = route(r_tokens + [8], "own-2")
        assert (acc.engine_id, acc.expected_cached_tokens) == ("py-b", 64)
        # Cleared: nothing of b is indexed, nothing is expected cached.
        assert b.client.report(kv_events=[cleared_event()]).ok
        assert engine_stats(cluster.target, "py-b").indexed_blocks == 0
        acc = route(r_tokens + [9], "own-3")
        assert acc.expected_cached_tokens == 0
        # The same token ids published as moelink hashes by a (no token ids)
        # are the same blocks: the two paths agree.
        assert a.client.report(kv_events=[stored_event(prompt_block_hashes(r_tokens, BLOCK))]).ok
        acc = route(r_tokens + [10], "own-4")
        assert (acc.engine_id, acc.expected_cached_tokens) == ("py-a", 112)
        assert a.errors == [] and b.errors == []
    finally:
        a.close()
        b.close()


def test_started_is_refused_after_a_cancel_and_rejected_moves_on(cluster):
    """STARTED's acknowledgement is the engine's permission to start: after a
    client's Cancel it is revoked (and the engine hears a CancelRun). A
    REJECTED request goes to another engine."""
    a = PyEngine(cluster.target, "py-a", auto=False).start()
    try:
        rng = random.Random(4)
        prompt = rand_tokens(rng, 40)
        out = {}
        req = make_request(prompt, max_new_tokens=4, request_id="to-cancel")
        t = generate_in_background(cluster.target, req, out)
        run = a.runs.get(timeout=10)
        assert run.request_id == "to-cancel"
        with SchedulerClient(cluster.target) as c:
            c.cancel("to-cancel")
            with pytest.raises(SchedulerError) as e:
                c.cancel("to-cancel")
            assert e.value.code == grpc.StatusCode.NOT_FOUND and "'to-cancel'" in e.value.details
        cancel = a.cancels.get(timeout=5)
        assert cancel.request_id == "to-cancel" and "cancelled by the client" in cancel.reason
        r = a.client.report(progress=[progress("to-cancel", STARTED)])
        assert r.ok and r.revoked == ["to-cancel"]  # never start it
        t.join(10)
        assert out["error"] is not None and out["error"].code == grpc.StatusCode.CANCELLED, out
        assert [ev.WhichOneof("kind") for ev in out["events"]] == ["accepted"]

        # REJECTED before starting: re-routed to b (a refused it), which serves it.
        b = PyEngine(cluster.target, "py-b").start()
        try:
            req = make_request(prompt, max_new_tokens=4, request_id="to-reject")
            # Route to a first: it holds the prompt's prefix.
            assert a.client.report(kv_events=[stored_event(prompt_block_hashes(prompt, BLOCK))]).ok
            t = generate_in_background(cluster.target, req, out)
            run = a.runs.get(timeout=10)
            assert run.request_id == "to-reject" and run.expected_cached_tokens == 32
            r = a.client.report(progress=[progress("to-reject", REJECTED, finish_reason="full")])
            assert r.ok and r.revoked == []
            t.join(10)
            assert out["error"] is None, out["error"]
            engines = [ev.accepted.engine_id for ev in out["events"] if ev.HasField("accepted")]
            assert engines == ["py-a", "py-b"]
            assert tokens_in_order(out["events"]) == sim_tokens(prompt, 4)
            assert out["events"][-1].finished.engine_id == "py-b"
            s = stats(cluster.target)
            assert (s.accepted, s.finished, s.failed, s.rerouted, s.requests_in_flight) == (2, 1, 1, 1, 0)
        finally:
            b.close()
    finally:
        a.close()


def test_an_unplaceable_kv_event_does_not_cost_the_engine_its_requests(cluster):
    a = PyEngine(cluster.target, "py-a", auto=False).start()
    try:
        rng = random.Random(5)
        prompt = rand_tokens(rng, 40)
        out = {}
        req = make_request(prompt, max_new_tokens=4, request_id="survivor")
        t = generate_in_background(cluster.target, req, out)
        run = a.runs.get(timeout=10)
        want = sim_tokens(run.prompt_tokens, 4)
        assert a.client.report(progress=[progress("survivor", STARTED)]).ok
        assert a.client.report(progress=[progress("survivor", RUNNING, want[:2], 0)],
                               kv_events=[stored_event(prompt_block_hashes(prompt, BLOCK))]).ok
        assert engine_stats(cluster.target, "py-a").indexed_blocks == 2
        # A stored event whose parent the scheduler never saw: dropped and
        # counted, the report accepted (events are hints), no new registration.
        incarnation = a.client.incarnation
        dropped = a.client.report(kv_events=[stored_event([123], parent=0xABCDEF, token_ids=[1] * BLOCK)])
        assert dropped.ok, (dropped.code, dropped.details)
        assert engine_stats(cluster.target, "py-a").dropped_kv_events == 1
        time.sleep(0.5)
        assert a.client.incarnation == incarnation
        # The engine runs its request on...
        r = a.client.report(progress=[progress("survivor", FINISHED, want[2:], 2)])
        t.join(10)
        assert out["error"] is None, out["error"]
        assert r.ok and r.revoked == [], (r.code, r.details, r.revoked)
        assert tokens_in_order(out["events"]) == want
        # ...and its blocks stay indexed.
        assert engine_stats(cluster.target, "py-a").indexed_blocks == 2
    finally:
        a.close()


def test_block_size_mismatch_is_refused_at_register(cluster):
    eng = EngineClient(cluster.target, "py-32", kv_capacity_blocks=64, block_size=32, max_batch=4,
                       on_run=lambda r: None)
    try:
        with pytest.raises(RuntimeError) as e:
            eng.start(timeout=1.0)
        msg = str(e.value)
        assert "FAILED_PRECONDITION" in msg and "block_size 32" in msg and "block size 16" in msg, msg
    finally:
        eng.close()


# ---------------------------------------------------------------------- authentication


def test_engine_token():
    """With --engine-token-file the scheduler refuses engines without the
    token; the Python client's error names it; the right token works;
    moelink-engine-sim without a token gives up and exits non-zero (it waits
    30 s for the registration: this test takes that long)."""
    c = LocalCluster(engines=0, engine_token="s3cret-token", scheduler_args=["--provisional-ttl-ms", "1"])
    c.start()
    sim_log = os.path.join(c.dir, "tokenless-sim.log")
    with open(sim_log, "w") as log:
        sim = subprocess.Popen([SIM_BIN, "--scheduler", c.target, "--engine-id", "sim-no-token",
                                "--time-scale", "0.01"], stdout=log, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        for token in ("wrong-token", None):
            bad = EngineClient(c.target, "py-bad", kv_capacity_blocks=64, block_size=BLOCK, max_batch=4,
                               on_run=lambda r: None, engine_token=token)
            try:
                with pytest.raises(RuntimeError) as e:
                    bad.start(timeout=1.0)
                msg = str(e.value)
                assert "UNAUTHENTICATED" in msg and "engine token" in msg and "authorization: Bearer" in msg, msg
            finally:
                bad.close()
        # A raw call without metadata: refused too, every EngineGateway method.
        with grpc.insecure_channel(c.target) as ch:
            gw = pb_grpc.EngineGatewayStub(ch)
            for call in (lambda: gw.Register(pb.RegisterRequest(engine=pb.EngineInfo(
                             engine_id="raw", kv_capacity_blocks=1, block_size=BLOCK, max_batch=1)), timeout=5),
                         lambda: gw.Report(pb.EngineReport(engine_id="raw", incarnation=1, seq=1), timeout=5),
                         lambda: gw.Leave(pb.LeaveRequest(engine_id="raw"), timeout=5),
                         lambda: next(iter(gw.ReceiveAssignments(
                             pb.ReceiveAssignmentsRequest(engine_id="raw"), timeout=5)))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        assert [e.engine_id for e in stats(c.target).engines] == []

        good = PyEngine(c.target, "py-good", token="s3cret-token").start()
        try:
            rng = random.Random(6)
            prompt = rand_tokens(rng, 20)
            with SchedulerClient(c.target) as cl:  # the Frontend needs no engine token
                done = cl.complete(prompt, max_new_tokens=3, timeout=15)
            assert (done.engine_id, done.tokens, done.finish_reason) == ("py-good", sim_tokens(prompt, 3), "length")
        finally:
            good.close()
        # The simulator without a token.
        rc = sim.wait(timeout=60)
        waited = time.monotonic() - started
        with open(sim_log) as f:
            log_text = f.read()
        assert rc != 0, log_text
        assert "could not register" in log_text and "engine token" in log_text, log_text
        assert waited < 60
        assert all(e.engine_id != "sim-no-token" for e in stats(c.target).engines)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
        print(c.logs())
        c.stop()
        shutil.rmtree(c.dir, ignore_errors=True)


def test_scheduler_refuses_to_listen_beyond_loopback_without_auth():
    with tempfile.TemporaryDirectory() as d:
        port_file = os.path.join(d, "port")
        p = subprocess.run([SCHEDULER_BIN, "--listen", "0.0.0.0:0", "--port-file", port_file],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert "--engine-token" in p.stderr and "0.0.0.0:0" in p.stderr and "beyond loopback" in p.stderr, p.stderr
        assert not os.path.exists(port_file)
        # With a token (file or environment) it serves.
        token_file = os.path.join(d, "token")
        with open(token_file, "w") as f:
            f.write("t0ken\n")
        for args, env in ((["--engine-token-file", token_file], None),
                          ([], dict(os.environ, MOELINK_ENGINE_TOKEN="t0ken")),
                          (["--allow-insecure-remote"], None)):
            if os.path.exists(port_file):
                os.remove(port_file)
            proc = subprocess.Popen([SCHEDULER_BIN, "--listen", "0.0.0.0:0", "--port-file", port_file] + args,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                wait_for(lambda: os.path.exists(port_file) or proc.poll() is not None, 20, "the port file")
                assert proc.poll() is None, proc.stdout.read()
                assert int(open(port_file).read()) > 0
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            assert proc.returncode == 0, proc.stdout.read()


def test_every_flag_the_refusal_suggests_exists():
    p = subprocess.run([SCHEDULER_BIN, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    suggested = set(re.findall(r"--[a-z][a-z-]+", p.stderr)) - {"--listen"}
    assert {"--engine-token-file", "--tls-cert", "--tls-key", "--allow-insecure-remote"} <= suggested, p.stderr
    helped = subprocess.run([SCHEDULER_BIN, "--help"], capture_output=True, text=True, timeout=30).stdout
    for flag in suggested:
        assert re.search(re.escape(flag) + r"\b(?!-)", helped), (flag, helped)
