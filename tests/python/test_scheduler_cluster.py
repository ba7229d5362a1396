"""moelink-scheduler with 2-8 moelink-engine-sim processes over loopback gRPC
(LocalCluster): routing by shared prefix, balance, engine death / hang /
rejoin under load, scheduler restart with the request log, every bad input
over the wire, redirect to the engines' HTTP front end, and a bounded soak.

The simulator's output is deterministic (token i = 1000 +
splitmix64(prompt_hash + i) % 30000, prompt_hash = block_hash(ROOT, prompt)),
so every finished request is checked token for token.

Time: every test bounds itself (asyncio.wait_for / deadlines, named in its
docstring); the file takes about a minute on a 2-core machine.

    MOELINK_PYTHONPATH=build-sched/python MOELINK_BIN_DIR=build-sched/tools/scheduler \
        python3 -m pytest -q tests/python/test_scheduler_cluster.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler_testlib import (  # noqa: I001 - first: skips this module when the scheduler is missing
    BLOCK,
    engine_stats,
    rand_tokens,
    sim_tokens,
    stats,
    wait_for,
)

import grpc  # noqa: E402

from moelink.scheduler import (  # noqa: E402
    AsyncSchedulerClient,
    CodepointTokenizer,
    SchedulerClient,
    SchedulerError,
    cleared_event,
    make_request,
    pb,
    removed_event,
    stored_event,
)
from moelink.scheduler.local_cluster import LocalCluster  # noqa: E402
from moelink.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: E402

OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
CANCELLED = grpc.StatusCode.CANCELLED
# Heartbeats for the failure tests: engines report every 50 ms when idle, a
# silent one is drained after 600 ms.
FAST_HEARTBEAT = ["--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "600"]
HEARTBEAT_TIMEOUT_S = 0.6


@contextlib.contextmanager
def logs_on_failure(cluster):
    """Appends the cluster's process logs to any assertion failing inside."""
    try:
        yield cluster
    except AssertionError as e:
        msg = e.args[0] if e.args else ""
        e.args = (f"{msg}\n---- cluster logs ({cluster.dir})\n{cluster.logs()}",) + e.args[1:]
        raise


def settle():
    """LocalCluster.start_engine returns once the engine registered; its
    assignment stream (what makes it routable) attaches just after."""
    time.sleep(0.3)


def run(coro, timeout):
    """Runs a coroutine with a hard time bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Rec:
    """One request as its client saw it."""

    def __init__(self, prompt, max_new, rid="", session=""):
        self.rid, self.prompt, self.max_new, self.session = rid, list(prompt), max_new, session
        self.engines = []      # (engine_id, client time) per Accepted
        self.expected_cached = []
        self.tokens = []
        self.bad_offsets = []  # Tokens events that did not continue the output
        self.finished = None
        self.code = None       # grpc.StatusCode once the stream ended
        self.details = ""
        self.t_submit = self.t_end = None
        self.cancel_ok = None  # True: our Cancel was accepted

    def feed(self, ev):
        kind = ev.WhichOneof("kind")
        if kind == "accepted":
            if self.rid and ev.accepted.request_id != self.rid:
                self.bad_offsets.append(f"accepted id {ev.accepted.request_id}")
            self.rid = ev.accepted.request_id
            self.engines.append((ev.accepted.engine_id, time.monotonic()))
            self.expected_cached.append(ev.accepted.expected_cached_tokens)
        elif kind == "tokens":
            if ev.tokens.offset != len(self.tokens):
                self.bad_offsets.append((ev.tokens.offset, len(self.tokens)))
            del self.tokens[ev.tokens.offset:]
            self.tokens.extend(ev.tokens.token_ids)
        elif kind == "finished":
            self.finished = ev.finished

    @property
    def engine(self):
        return self.engines[-1][0] if self.engines else None

    def __repr__(self):
        return (f"<{self.rid} engines={[e for e, _ in self.engines]} tokens={len(self.tokens)}/{self.max_new} "
                f"code={self.code and self.code.name} {self.details!r} finished={self.finished is not None}>")


async def generate(client, rec, timeout=60.0, stream_interval=0):
    req = make_request(rec.prompt, max_new_tokens=rec.max_new, request_id=rec.rid,
                       session_id=rec.session, stream_interval=stream_interval)
    rec.t_submit = time.monotonic()
    try:
        async for ev in client.generate(request=req, timeout=timeout):
            rec.feed(ev)
        rec.code = OK
    except SchedulerError as e:
        rec.code, rec.details = e.code, e.details
    rec.t_end = time.monotonic()
    return rec


def check_outcomes(recs, disrupted=None):
    """Every request has exactly one outcome: finished with exactly its
    tokens; CANCELLED if (and only if) our Cancel was accepted; UNAVAILABLE
    only on an engine we killed or stopped (`disrupted`: engine id -> times,
    or (before, after) spans for a kill that takes a while to land) while the
    request was in flight."""
    disrupted = disrupted or {}
    problems = []
    for r in recs:
        if r.bad_offsets:
            problems.append(f"{r}: output not in order: {r.bad_offsets}")
        if r.code == OK:
            if r.finished is None:
                problems.append(f"{r}: stream ended OK without Finished")
            elif r.tokens != sim_tokens(r.prompt, r.max_new):
                problems.append(f"{r}: wrong tokens")
            elif (r.finished.output_tokens, r.finished.finish_reason) != (r.max_new, "length") or \
                    r.finished.engine_id != r.engine:
                problems.append(f"{r}: Finished {r.finished}")
            if r.cancel_ok:
                problems.append(f"{r}: finished although its Cancel was accepted")
        elif r.code == CANCELLED:
            if not r.cancel_ok:
                problems.append(f"{r}: CANCELLED without an accepted Cancel")
        elif r.code == UNAVAILABLE:
            spans = [t if isinstance(t, tuple) else (t, t) for t in disrupted.get(r.engine, [])]
            if not any(r.t_submit <= after and before <= r.t_end for before, after in spans):
                problems.append(f"{r}: UNAVAILABLE but its engine was not disrupted while it ran")
            elif f"'{r.engine}'" not in r.details:
                problems.append(f"{r}: UNAVAILABLE does not name the engine")
            if r.cancel_ok:
                problems.append(f"{r}: failed although its Cancel was accepted")
        else:
            problems.append(f"{r}: unexpected outcome")
    assert not problems, "\n".join(problems[:30]) + f"\n({len(problems)} problems)"


def wait_idle(cluster, timeout=10.0):
    """Stats once nothing is in flight."""
    return wait_for(lambda: (lambda s: s if s.requests_in_flight == 0 else None)(stats(cluster.target)),
                    timeout, "requests_in_flight == 0")


def check_counters(s):
    assert s.accepted == s.finished + s.failed + s.requests_in_flight, s


def stop_and_check(cluster):
    """Stops the cluster (SIGTERM): every process exits 0, and no request ran
    to the end on two engines (from the engines' stats files)."""
    engine_stats_files = cluster.stop()
    codes = {"scheduler": cluster.scheduler_proc.returncode}
    codes.update({cluster.engine_id(i): p.returncode for i, p in cluster.engines.items()})
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}"
    assert len(engine_stats_files) == len(cluster.engines), sorted(engine_stats_files)
    ran = Counter(r["id"] for st in engine_stats_files.values() for r in st["requests"])
    dup = {k: v for k, v in ran.items() if v > 1}
    assert not dup, f"requests run on more than one engine: {dup}"


# ---------------------------------------------------------------------- a. routing by prefix


@pytest.mark.parametrize("variant", ["provisional", "events", "events-with-tokens"])
def test_routes_a_shared_prefix_to_the_engine_holding_it(variant):
    """4 engines. A request with a 520-token prefix P goes to some engine E;
    then 4 sequential and 8 concurrent requests P + other suffixes all go to
    E and find >= 512 tokens (P's full blocks) cached there. 'provisional':
    default scheduler (its routing entries may answer); 'events': provisional
    entries live 20 ms and the test waits for E's KV events, so those drive
    the routing; 'events-with-tokens': the same with engine-own hashes plus
    token ids (vLLM style). Bound: 30 s."""
    args = [] if variant == "provisional" else ["--provisional-ttl-ms", "20"]
    sim_args = ["--events-with-tokens"] if variant == "events-with-tokens" else []
    rng = random.Random(variant)
    p = rand_tokens(rng, 520)
    full = len(p) // BLOCK * BLOCK  # 512
    with LocalCluster(engines=4, time_scale=0.03, scheduler_args=args, sim_args=sim_args) as cluster, \
            logs_on_failure(cluster):
        settle()
        with SchedulerClient(cluster.target) as client:
            first = client.complete(p + rand_tokens(rng, 9), max_new_tokens=8, timeout=20)
            e = first.engine_id
            assert e and first.cached_tokens == 0, first
            if variant != "provisional":
                # E's stored events (prompt + output blocks) reached the index;
                # the provisional entries have expired.
                wait_for(lambda: engine_stats(cluster.target, e).indexed_blocks >= len(p) // BLOCK, 10,
                         f"{e}'s KV events")
                time.sleep(0.1)
                s = stats(cluster.target)
                assert all(x.indexed_blocks == 0 for x in s.engines if x.engine_id != e), s
            for i in range(4):
                prompt = p + rand_tokens(rng, 5 + 7 * i)
                events = list(client.generate(prompt, max_new_tokens=8, timeout=20))
                rec = Rec(prompt, 8)
                for ev in events:
                    rec.feed(ev)
                rec.code = OK
                assert rec.engine == e and rec.expected_cached[-1] >= full, (rec, rec.expected_cached)
                assert rec.finished.cached_tokens >= full and rec.tokens == sim_tokens(prompt, 8), rec

        async def concurrent():
            client = AsyncSchedulerClient(cluster.target)
            try:
                recs = [Rec(p + rand_tokens(rng, 3 + 5 * i), 16) for i in range(8)]
                return await asyncio.gather(*(generate(client, r, timeout=20) for r in recs))
            finally:
                await client.close()

        recs = run(concurrent(), 30)
        check_outcomes(recs)
        assert [r.engine for r in recs] == [e] * 8, recs
        assert all(r.finished.cached_tokens >= full and r.expected_cached[-1] >= full for r in recs), \
            [(r.finished.cached_tokens, r.expected_cached) for r in recs]
        s = wait_idle(cluster)
        check_counters(s)
        assert (s.accepted, s.finished, s.failed) == (13, 13, 0)
        stop_and_check(cluster)


def test_sticky_sessions_follow_their_engine_until_it_dies():
    """4 engines: each of 3 sessions' random prompts stay on one engine; when
    that engine is killed, the session moves to another and stays there.
    Bound: 30 s."""
    rng = random.Random(21)
    with LocalCluster(engines=4, time_scale=0.02, scheduler_args=FAST_HEARTBEAT) as cluster, \
            logs_on_failure(cluster):
        settle()
        with SchedulerClient(cluster.target) as c:
            def engines_of(session, n):
                out = []
                for _ in range(n):
                    prompt = rand_tokens(rng, rng.randrange(20, 200))
                    done = c.complete(prompt, max_new_tokens=4, session_id=session, timeout=10)
                    assert done.tokens == sim_tokens(prompt, 4)
                    out.append(done.engine_id)
                return out

            homes = {}
            for session in ("alice", "bob", "carol"):
                got = engines_of(session, 6)
                assert len(set(got)) == 1, (session, got)
                homes[session] = got[0]
            victim = homes["alice"]
            cluster.kill_engine(int(victim.split("-")[1]))
            wait_for(lambda: not engine_stats(cluster.target, victim).alive, 5, f"{victim} drained")
            got = engines_of("alice", 6)
            assert victim not in got and len(set(got)) == 1, got
            for session in ("bob", "carol"):
                if homes[session] != victim:
                    assert set(engines_of(session, 3)) == {homes[session]}
        cluster.start_engine(int(victim.split("-")[1]))
        stop_and_check(cluster)


# ---------------------------------------------------------------------- b. balance


@pytest.mark.parametrize("policy", ["ttft", "round-robin", "least-loaded"])
def test_spreads_unshared_requests(policy):
    """8 engines, 64 concurrent requests with random prompts (nothing shared):
    every engine gets some, none more than twice the mean; round-robin gives
    each exactly 8. Bound: 30 s."""
    rng = random.Random(42)
    with LocalCluster(engines=8, policy=policy, time_scale=0.02) as cluster, logs_on_failure(cluster):
        settle()

        async def burst():
            client = AsyncSchedulerClient(cluster.target)
            try:
                recs = [Rec(rand_tokens(rng, rng.randrange(200, 600)), 24, rid=f"{policy}-{i}")
                        for i in range(64)]
                return await asyncio.gather(*(generate(client, r, timeout=25, stream_interval=8) for r in recs))
            finally:
                await client.close()

        recs = run(burst(), 30)
        check_outcomes(recs)
        counts = Counter(r.engine for r in recs)
        assert Counter(r.finished.engine_id for r in recs) == counts
        engines = {cluster.engine_id(i) for i in range(8)}
        assert set(counts) == engines, (policy, counts)
        mean = 64 / 8
        assert max(counts.values()) <= 2 * mean, (policy, counts)
        if policy == "round-robin":
            assert set(counts.values()) == {8}, counts
        s = wait_idle(cluster)
        check_counters(s)
        assert s.policy == policy and (s.accepted, s.finished) == (64, 64)
        assert {e.engine_id: e.assigned for e in s.engines} == dict(counts)
        assert all(e.outstanding == 0 for e in s.engines)
        stop_and_check(cluster)


# ---------------------------------------------------------------------- c. engine death


def test_engine_death_hang_and_rejoin_under_load():
    """4 engines of 6 slots, 40 concurrent requests of 300 tokens; one engine is
    SIGKILLed mid-way: every request finishes with its exact tokens, or fails
    UNAVAILABLE if it had started on the killed engine (within the heartbeat
    timeout + 2 s); none lost or run twice. The engine restarts with the same
    id: alive, a new incarnation, nothing indexed, and it gets new requests.
    Then another engine is SIGSTOPped under load (a hung engine): its
    requests' outcomes (failed, or moved to another engine) come within the
    heartbeat timeout + 2 s; after SIGCONT it registers again and serves.
    Bound: 60 s."""
    rng = random.Random(7)
    margin = 2.0
    # 6 slots per engine: of the ~10 requests each engine gets, some wait in
    # its queue (those move to other engines), the others run (those fail).
    with LocalCluster(engines=4, max_batch=6, time_scale=0.03, scheduler_args=FAST_HEARTBEAT) as cluster, \
            logs_on_failure(cluster):
        settle()
        ids = [cluster.engine_id(i) for i in range(4)]

        async def load_and_disrupt(action, tag):
            """40 requests; once every engine streams, `action` hits the
            engine running the most; returns (records, engine index, time)."""
            client = AsyncSchedulerClient(cluster.target)
            try:
                recs = [Rec(rand_tokens(rng, rng.randrange(50, 300)), 300, rid=f"{tag}-{i}") for i in range(40)]
                tasks = [asyncio.ensure_future(generate(client, r, timeout=40, stream_interval=4)) for r in recs]
                deadline = time.monotonic() + 20
                while True:
                    streaming = Counter(r.engine for r in recs if len(r.tokens) >= 20 and r.code is None)
                    if len(streaming) == 4 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.01)
                assert len(streaming) == 4, (streaming, recs)
                # The engine holding the most: some run there, some wait.
                holding = Counter(r.engine for r in recs if r.code is None)
                victim_id = max(holding, key=lambda k: holding[k])
                assert holding[victim_id] > 6, holding
                victim = ids.index(victim_id)
                t = time.monotonic()
                await asyncio.get_running_loop().run_in_executor(None, action, victim)
                await asyncio.gather(*tasks)
                return recs, victim, t
            finally:
                await client.close()

        async def more(tag, n=16):
            client = AsyncSchedulerClient(cluster.target)
            try:
                recs = [Rec(rand_tokens(rng, rng.randrange(50, 300)), 20, rid=f"{tag}-{i}") for i in range(n)]
                return await asyncio.gather(*(generate(client, r, timeout=20) for r in recs))
            finally:
                await client.close()

        # ---- SIGKILL
        before = {e.engine_id: e.incarnation for e in stats(cluster.target).engines}
        recs, victim, t_kill = run(load_and_disrupt(lambda i: cluster.kill_engine(i), "kill"), 45)
        vid = ids[victim]
        check_outcomes(recs, {vid: [t_kill]})
        failed = [r for r in recs if r.code == UNAVAILABLE]
        on_victim = [r for r in recs if vid in [e for e, _ in r.engines]]
        assert failed, f"no request had started on {vid}: {recs}"
        assert all(r.t_end - t_kill <= HEARTBEAT_TIMEOUT_S + margin for r in failed), \
            [(r.rid, r.t_end - t_kill) for r in failed]
        assert all("stopped heartbeating" in r.details for r in failed), failed
        moved = [r for r in on_victim if r.code == OK and r.engine != vid]
        assert moved, f"nothing waited on {vid}: {on_victim}"
        for r in moved:  # re-routed before starting: a second Accepted, from another engine
            assert len(r.engines) >= 2 and r.engines[-2][0] == vid, r
            assert r.engines[-1][1] - t_kill <= margin, (r, r.engines[-1][1] - t_kill)  # at once
        s = wait_idle(cluster)
        check_counters(s)
        assert (s.accepted, s.finished, s.failed) == (40, 40 - len(failed), len(failed))
        dead = engine_stats(cluster.target, vid)
        assert not dead.alive and dead.outstanding == 0 and dead.indexed_blocks == 0, dead

        # ---- rejoin with the same id
        cluster.start_engine(victim)
        settle()
        e = engine_stats(cluster.target, vid)
        assert e.alive and e.incarnation != before[vid] and e.indexed_blocks == 0, e
        recs2 = run(more("after-kill"), 30)
        check_outcomes(recs2)
        assert any(r.engine == vid for r in recs2), Counter(r.engine for r in recs2)

        # ---- SIGSTOP: a hung engine
        recs3, victim2, t_stop = run(load_and_disrupt(lambda i: cluster.kill_engine(i, signal.SIGSTOP), "stop"), 45)
        vid2 = ids[victim2]
        try:
            check_outcomes(recs3, {vid2: [t_stop]})
            bound = HEARTBEAT_TIMEOUT_S + margin
            failed = [r for r in recs3 if r.code == UNAVAILABLE]
            assert failed, f"no request had started on {vid2}: {recs3}"
            assert all(r.t_end - t_stop <= bound for r in failed), [(r.rid, r.t_end - t_stop) for r in failed]
            moved = 0
            for r in recs3:
                ran_there = [i for i, (e, _) in enumerate(r.engines) if e == vid2]
                if r.code == OK and ran_there and r.engine != vid2:
                    moved += 1
                    # Moved off the hung engine: its next Accepted came in time.
                    moved_at = r.engines[ran_there[-1] + 1][1]
                    assert moved_at - t_stop <= bound, (r, moved_at - t_stop)
            assert moved, f"nothing waited on {vid2}: {recs3}"
            s = wait_idle(cluster)
            check_counters(s)
            hung = engine_stats(cluster.target, vid2)
            assert not hung.alive and hung.outstanding == 0, hung
        finally:
            cluster.kill_engine(victim2, signal.SIGCONT)
        inc = hung.incarnation
        wait_for(lambda: (lambda x: x and x.alive and x.incarnation != inc)(engine_stats(cluster.target, vid2)),
                 10, f"{vid2} registering again after SIGCONT")
        settle()
        recs4 = run(more("after-stop"), 30)
        check_outcomes(recs4)
        assert any(r.engine == vid2 for r in recs4), Counter(r.engine for r in recs4)
        s = wait_idle(cluster)
        check_counters(s)
        assert all(e.alive for e in s.engines), s
        assert cluster.scheduler_proc.poll() is None
        stop_and_check(cluster)


# ---------------------------------------------------------------------- d. scheduler restart


def _submit_then_kill_scheduler(cluster, rng, n, max_new, stop_engines=False):
    """n concurrent requests (named by the scheduler); once the running ones
    stream, the scheduler is SIGKILLed (after SIGSTOPping the engines, with
    stop_engines). Returns the records (ids from Accepted)."""

    async def go():
        client = AsyncSchedulerClient(cluster.target)
        try:
            recs = [Rec(rand_tokens(rng, rng.randrange(40, 200)), max_new) for _ in range(n)]
            tasks = [asyncio.ensure_future(generate(client, r, timeout=30, stream_interval=4)) for r in recs]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if all(r.engines for r in recs) and sum(len(r.tokens) >= 30 for r in recs) >= 4:
                    break
                await asyncio.sleep(0.01)
            assert all(r.engines for r in recs), recs
            if stop_engines:
                for i in cluster.engines:
                    cluster.kill_engine(i, signal.SIGSTOP)
            cluster.kill_scheduler()
            await asyncio.gather(*tasks)
            return recs
        finally:
            await client.close()

    return run(go(), 40)


def _resume(target, rec, timeout=30.0, from_token=None):
    """Resumes rec from the tokens it has; returns (events, error)."""
    events = []
    if from_token is None:
        from_token = len(rec.tokens)
    try:
        with SchedulerClient(target) as c:
            for ev in c.resume(rec.rid, from_token=from_token, timeout=timeout):
                events.append(ev)
    except SchedulerError as e:
        return events, e
    return events, None


def test_scheduler_restart_with_the_request_log():
    """Request log on; 20 requests of 300 tokens on 2 engines of 4 slots (so
    12 wait in the engines' queues, accepted but not started); the scheduler
    is SIGKILLed mid-way and restarted on the same port. Once the engines
    have registered again (holding what they ran), every client resumes from
    the tokens it has, and every request completes with exactly its tokens,
    no gap, no repeat. Bound: 70 s."""
    rng = random.Random(9)
    # A grace well beyond the engines' reconnect time (about a second), so
    # every engine reclaims what it holds even on a loaded machine.
    with LocalCluster(engines=2, max_batch=4, time_scale=0.03, request_log=True,
                      scheduler_args=["--recovery-grace-ms", "15000"]) as cluster, logs_on_failure(cluster):
        settle()
        recs = _submit_then_kill_scheduler(cluster, rng, 20, 300)
        assert all(r.code in (OK, UNAVAILABLE) for r in recs), recs
        broken = [r for r in recs if r.code == UNAVAILABLE]
        assert len(broken) >= 12, recs
        not_started = [r for r in broken if not r.tokens]
        assert len(not_started) >= 8, recs  # waiting in an engine's queue when the scheduler died
        t_restart = time.monotonic()
        cluster.restart_scheduler()
        wait_for(lambda: (lambda s: len(s.engines) == 2 and all(e.alive for e in s.engines))(stats(cluster.target)),
                 14, "both engines registering with the new scheduler")
        reg_s = time.monotonic() - t_restart
        s = stats(cluster.target)
        # Recovered from the log: the unfinished ones (and, rarely, one that
        # finished just before the kill, its done record not yet on disk).
        assert len(broken) <= s.accepted <= len(recs), (s, recs)
        recovered = s.accepted

        with ThreadPoolExecutor(len(broken)) as pool:
            results = list(pool.map(lambda r: _resume(cluster.target, r), broken))
        problems = []
        for r, (events, err) in zip(broken, results):
            if err is not None:
                problems.append(f"{r}: resume failed: {err}")
                continue
            kinds = [ev.WhichOneof("kind") for ev in events]
            toks = [ev.tokens for ev in events if ev.HasField("tokens")]
            if toks and toks[0].offset != len(r.tokens):
                problems.append(f"{r}: resumed at offset {toks[0].offset}")
            had = len(r.tokens)
            for ev in events:
                r.feed(ev)
            if kinds.count("finished") != 1 or kinds[-1] != "finished":
                problems.append(f"{r}: resumed stream {kinds}")
            elif r.tokens != sim_tokens(r.prompt, r.max_new) or r.bad_offsets:
                problems.append(f"{r}: wrong tokens after resuming at {had} ({r.bad_offsets})")
        assert not problems, "\n".join(problems) + f"\n(engines back after {reg_s:.2f} s)"
        for r in recs:
            if r.code == OK:  # finished before the kill
                assert r.tokens == sim_tokens(r.prompt, r.max_new), r
        s = wait_idle(cluster)
        check_counters(s)
        assert (s.finished, s.failed) == (len(broken), recovered - len(broken)), s
        # A request resumed again after it finished replays its whole output.
        events, err = _resume(cluster.target, Rec([], 0, rid=broken[0].rid))
        assert err is None and [ev.tokens for ev in events if ev.HasField("tokens")][0].offset == 0
        assert events[-1].finished.output_tokens == 300
        assert cluster.scheduler_proc.poll() is None
        stop_and_check(cluster)


def test_resume_right_after_a_scheduler_restart():
    """As above, but the clients resume before the engines are back (they
    are SIGSTOPped through the restart and continued 0.5 s later). Bound: 40 s."""
    rng = random.Random(10)
    with LocalCluster(engines=2, max_batch=4, time_scale=0.03, request_log=True,
                      scheduler_args=["--recovery-grace-ms", "10000"]) as cluster, logs_on_failure(cluster):
        settle()
        recs = _submit_then_kill_scheduler(cluster, rng, 6, 200, stop_engines=True)
        started = [r for r in recs if r.code == UNAVAILABLE and r.tokens]
        assert started, recs
        cluster.restart_scheduler()
        threading.Timer(0.5, lambda: [cluster.kill_engine(i, signal.SIGCONT) for i in cluster.engines]).start()
        with ThreadPoolExecutor(len(started)) as pool:
            results = list(pool.map(lambda r: _resume(cluster.target, r), started))
        for r, (events, err) in zip(started, results):
            assert err is None, f"{r}: {err}"
            for ev in events:
                r.feed(ev)
            assert r.tokens == sim_tokens(r.prompt, r.max_new), r


def test_engines_return_within_the_default_recovery_grace():
    """Request log, default grace; the scheduler is down 0.3 s; the requests
    that had started are resumed once the engines are back, which takes them
    well under a second (their registration waits for the reconnecting
    channel: with fail-fast calls only gRPC's 5 s backup poller noticed the
    new connection, 4-10 s, and once past the 10 s grace). Bound: 40 s."""
    rng = random.Random(15)
    with LocalCluster(engines=2, max_batch=4, time_scale=0.03, request_log=True) as cluster, \
            logs_on_failure(cluster):
        settle()
        recs = _submit_then_kill_scheduler(cluster, rng, 8, 400)
        started = [r for r in recs if r.code == UNAVAILABLE and r.tokens]
        assert started, recs
        time.sleep(0.3)
        t = time.monotonic()
        cluster.start_scheduler()
        wait_for(lambda: len(stats(cluster.target).engines) == 2, 15, "the engines registering again")
        back = time.monotonic() - t
        assert back < 3.0, f"the engines took {back:.2f} s to register again"
        # (From token 0: the whole output, whatever the client had.)
        with ThreadPoolExecutor(len(started)) as pool:
            results = list(pool.map(lambda r: _resume(cluster.target, r, timeout=10, from_token=0), started))
        for r, (events, err) in zip(started, results):
            assert err is None, f"{r}: {err} (engines back after {back:.2f} s)"
            assert [t for ev in events if ev.HasField("tokens") for t in ev.tokens.token_ids] == \
                sim_tokens(r.prompt, r.max_new), r


def test_a_request_routed_back_to_the_engine_that_released_it_still_runs():
    """One engine of one slot, time scale 1 (so A's 8000-token prefill takes
    ~2.7 s and the engine's loop is asleep in it); B waits. The engine is
    stopped through a scheduler restart until the grace (300 ms) is over: A
    fails (it had started), B is pending. Bound: 30 s."""
    rng = random.Random(16)
    with LocalCluster(engines=1, max_batch=1, time_scale=1.0, request_log=True,
                      scheduler_args=["--recovery-grace-ms", "300"]) as cluster, logs_on_failure(cluster):
        settle()

        async def go():
            client = AsyncSchedulerClient(cluster.target)
            try:
                a = Rec(rand_tokens(rng, 8000), 4, rid="A")
                b = Rec(rand_tokens(rng, 50), 4, rid="B")
                ta = asyncio.ensure_future(generate(client, a, timeout=20))
                await asyncio.sleep(0.3)
                tb = asyncio.ensure_future(generate(client, b, timeout=20))
                await asyncio.sleep(0.3)
                assert a.engines and b.engines and not a.tokens, (a, b)
                cluster.kill_engine(0, signal.SIGSTOP)
                cluster.kill_scheduler()
                await asyncio.gather(ta, tb)
                return a, b
            finally:
                await client.close()

        a, b = run(go(), 20)
        cluster.start_scheduler()
        time.sleep(0.8)  # the grace passes without the engine
        cluster.kill_engine(0, signal.SIGCONT)
        events, err = _resume(cluster.target, a)
        assert err is not None and err.code == UNAVAILABLE and "did not return" in err.details, (events, err)
        events, err = _resume(cluster.target, b, timeout=5)
        assert err is None, f"B: {err}\n{stats(cluster.target)}"
        for ev in events:
            b.feed(ev)
        assert b.tokens == sim_tokens(b.prompt, 4)


# ---------------------------------------------------------------------- e. bad input


def _code(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return OK, ""


def _expect(fn, code, *fragments):
    got, details = _code(fn)
    assert got == code, (got, details, code)
    for f in fragments:
        assert f in details, (f, details)
    return details


def test_bad_input_over_the_wire():
    """Every refusal the contract lists, as gRPC status + message, through
    the raw stubs; the scheduler serves a normal request afterwards. Bound: 30 s."""
    with LocalCluster(engines=1, kv_blocks=256, time_scale=0.02,
                      scheduler_args=["--max-prompt-tokens", "4096", "--heartbeat-timeout-ms", "10000"]) as cluster, \
                              logs_on_failure(cluster):
        settle()
        ch = grpc.insecure_channel(cluster.target)
        gw, fe = pb_grpc.EngineGatewayStub(ch), pb_grpc.FrontendStub(ch)

        def info(engine_id="raw-1", block_size=BLOCK, kv=64, batch=4):
            return pb.EngineInfo(engine_id=engine_id, kv_capacity_blocks=kv, block_size=block_size,
                                 max_batch=batch)

        def register(**kw):
            return gw.Register(pb.RegisterRequest(engine=info(**kw)), timeout=5)

        def report(engine_id, inc, seq, events=(), prog=()):
            return gw.Report(pb.EngineReport(engine_id=engine_id, incarnation=inc, seq=seq,
                                             kv_events=list(events), progress=list(prog)), timeout=5)

        def first_assignment(engine_id, inc):
            call = gw.ReceiveAssignments(pb.ReceiveAssignmentsRequest(engine_id=engine_id, incarnation=inc),
                                         timeout=1)
            return next(iter(call))

        # ---- Register
        _expect(lambda: register(block_size=32), grpc.StatusCode.FAILED_PRECONDITION,
                "block_size 32", "'raw-1'", "block size 16", "--block-size")
        _expect(lambda: register(engine_id="bad id!"), grpc.StatusCode.INVALID_ARGUMENT, "engine_id", "bad id!")
        _expect(lambda: register(engine_id="x" * 65), grpc.StatusCode.INVALID_ARGUMENT, "1..64")
        _expect(lambda: register(kv=0), grpc.StatusCode.INVALID_ARGUMENT, "kv_capacity_blocks 0")
        _expect(lambda: register(batch=0), grpc.StatusCode.INVALID_ARGUMENT, "max_batch 0")
        # ---- unknown engine
        _expect(lambda: report("ghost", 1, 1), grpc.StatusCode.NOT_FOUND, "engine_id 'ghost'", "not registered")
        _expect(lambda: first_assignment("ghost", 1), grpc.StatusCode.NOT_FOUND, "'ghost'")
        _expect(lambda: gw.Leave(pb.LeaveRequest(engine_id="ghost", incarnation=1), timeout=5),
                grpc.StatusCode.NOT_FOUND, "'ghost'")
        # ---- stale incarnation, out-of-order seq
        inc1 = register().incarnation
        assert report("raw-1", inc1, 1).acked_seq == 1
        inc2 = register().incarnation
        assert inc2 != inc1
        _expect(lambda: report("raw-1", inc1, 2), grpc.StatusCode.FAILED_PRECONDITION,
                f"incarnation {inc1}", "not the current", "register again")
        _expect(lambda: first_assignment("raw-1", inc1), grpc.StatusCode.FAILED_PRECONDITION, "incarnation")
        assert report("raw-1", inc2, 5).acked_seq == 5
        # (not FAILED_PRECONDITION, which tells the engine to register again)
        _expect(lambda: report("raw-1", inc2, 5), grpc.StatusCode.ALREADY_EXISTS,
                "seq 5", "last accepted 5", "out of order or repeated")
        _expect(lambda: report("raw-1", inc2, 3), grpc.StatusCode.ALREADY_EXISTS, "seq 3")
        # ---- malformed events and progress (each refused whole, its seq not used up)
        toks = list(range(BLOCK))
        _expect(lambda: report("raw-1", inc2, 6, [stored_event([1, 2], token_ids=[1, 2, 3])]),
                grpc.StatusCode.INVALID_ARGUMENT, "kv_events[0].stored.token_ids has 3 tokens", "need 32")
        _expect(lambda: report("raw-1", inc2, 6, [stored_event([])]), grpc.StatusCode.INVALID_ARGUMENT,
                "block_hashes is empty")
        _expect(lambda: report("raw-1", inc2, 6, [pb.KvEvent()]), grpc.StatusCode.INVALID_ARGUMENT,
                "kv_events[0] has no event")
        _expect(lambda: report("raw-1", inc2, 6, prog=[pb.RequestProgress(phase=pb.RequestProgress.RUNNING)]),
                grpc.StatusCode.INVALID_ARGUMENT, "progress[0].request_id is empty")
        _expect(lambda: report("raw-1", inc2, 6, prog=[pb.RequestProgress(request_id="r")]),
                grpc.StatusCode.INVALID_ARGUMENT, "progress[0].phase 0")
        _expect(lambda: report("raw-1", inc2, 6, prog=[pb.RequestProgress(request_id="r", phase=42)]),
                grpc.StatusCode.INVALID_ARGUMENT, "phase 42")
        assert engine_stats(cluster.target, "raw-1").indexed_blocks == 0  # nothing of those applied
        # An event whose parent is unknown is dropped and counted, the rest applied.
        ack = report("raw-1", inc2, 6, [stored_event([7], token_ids=toks),
                                        stored_event([8], parent=0xABCDEF, token_ids=toks)],
                     [pb.RequestProgress(request_id="nobody", phase=pb.RequestProgress.RUNNING)])
        assert ack.acked_seq == 6 and list(ack.revoked) == ["nobody"]
        assert engine_stats(cluster.target, "raw-1").indexed_blocks == 1
        assert engine_stats(cluster.target, "raw-1").dropped_kv_events == 1
        _expect(lambda: gw.Leave(pb.LeaveRequest(engine_id="raw-1", incarnation=inc1), timeout=5),
                grpc.StatusCode.FAILED_PRECONDITION, "incarnation")
        gw.Leave(pb.LeaveRequest(engine_id="raw-1", incarnation=inc2), timeout=5)
        _expect(lambda: report("raw-1", inc2, 7), grpc.StatusCode.FAILED_PRECONDITION, "left")

        # ---- Frontend
        def gen(prompt=(1, 2, 3), max_new=4, **kw):
            req = pb.GenerateRequest(prompt_tokens=list(prompt), sampling=pb.SamplingParams(
                max_new_tokens=max_new, temperature=kw.pop("temperature", 0.0)), **kw)
            return list(fe.Generate(req, timeout=10))

        _expect(lambda: gen(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens is empty")
        _expect(lambda: gen(prompt=[1] * 4097), grpc.StatusCode.OUT_OF_RANGE,
                "4097 tokens", "limit is 4096", "--max-prompt-tokens")
        _expect(lambda: gen(prompt=[1] * 4000, max_new=200), grpc.StatusCode.OUT_OF_RANGE,
                "exceed the largest engine's KV cache (4096 tokens)")
        _expect(lambda: gen(max_new=0), grpc.StatusCode.OUT_OF_RANGE, "sampling.max_new_tokens 0", "1..32768")
        _expect(lambda: gen(max_new=40000), grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens 40000")
        _expect(lambda: gen(request_id="has space"), grpc.StatusCode.INVALID_ARGUMENT, "request_id 'has space'")
        _expect(lambda: gen(request_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT, "1..128")
        _expect(lambda: gen(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature")
        _expect(lambda: gen(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature")
        _expect(lambda: gen(stream_interval=5000), grpc.StatusCode.INVALID_ARGUMENT, "stream_interval 5000")
        _expect(lambda: gen(session_id="s" * 300), grpc.StatusCode.INVALID_ARGUMENT, "session_id", "at most 256")
        _expect(lambda: gen(redirect=True), grpc.StatusCode.UNAVAILABLE, "no live engine registered an address")
        # Duplicate request id: while in flight, and after it finished.
        first = fe.Generate(pb.GenerateRequest(request_id="dup", prompt_tokens=[5, 6, 7],
                                               sampling=pb.SamplingParams(max_new_tokens=200)), timeout=20)
        acc = next(iter(first))
        assert acc.accepted.request_id == "dup"
        _expect(lambda: gen(request_id="dup"), grpc.StatusCode.ALREADY_EXISTS, "'dup'", "already accepted")
        rest = list(first)
        assert rest[-1].finished.output_tokens == 200
        _expect(lambda: gen(request_id="dup"), grpc.StatusCode.ALREADY_EXISTS, "'dup'")
        # Resume and Cancel.
        _expect(lambda: list(fe.Resume(pb.ResumeRequest(request_id="nope"), timeout=5)),
                grpc.StatusCode.NOT_FOUND, "'nope'")
        _expect(lambda: list(fe.Resume(pb.ResumeRequest(request_id="dup", from_token=201), timeout=5)),
                grpc.StatusCode.OUT_OF_RANGE, "from_token 201", "200 output tokens")
        _expect(lambda: fe.Cancel(pb.CancelRequest(request_id="nope"), timeout=5), grpc.StatusCode.NOT_FOUND, "'nope'")
        _expect(lambda: fe.Cancel(pb.CancelRequest(request_id="dup"), timeout=5), grpc.StatusCode.NOT_FOUND,
                "not in flight")
        tail = list(fe.Resume(pb.ResumeRequest(request_id="dup", from_token=190), timeout=5))
        assert tail[0].tokens.offset == 190 and len(tail[0].tokens.token_ids) == 10
        assert tail[-1].finished.output_tokens == 200

        # ---- still serving
        assert cluster.scheduler_proc.poll() is None
        rng = random.Random(12)
        prompt = rand_tokens(rng, 100)
        with SchedulerClient(cluster.target) as c:
            done = c.complete(prompt, max_new_tokens=10, timeout=20)
        assert (done.engine_id, done.tokens) == ("sim-0", sim_tokens(prompt, 10))
        s = wait_idle(cluster)
        check_counters(s)
        assert (s.accepted, s.finished, s.failed) == (2, 2, 0), s
        ch.close()
        stop_and_check(cluster)


@pytest.mark.parametrize("case", ["parent-without-tokens", "parent-removed", "parent-cleared"])
def test_kv_events_referring_to_a_parent_dropped_in_the_same_report(case):
    """Bound: 10 s."""
    with LocalCluster(engines=0) as cluster, logs_on_failure(cluster):
        ch = grpc.insecure_channel(cluster.target)
        gw = pb_grpc.EngineGatewayStub(ch)
        inc = gw.Register(pb.RegisterRequest(engine=pb.EngineInfo(
            engine_id="raw", kv_capacity_blocks=64, block_size=BLOCK, max_batch=4)), timeout=5).incarnation
        toks = list(range(BLOCK))
        seq = 1
        if case != "parent-without-tokens":
            gw.Report(pb.EngineReport(engine_id="raw", incarnation=inc, seq=1,
                                      kv_events=[stored_event([111], token_ids=toks)]), timeout=5)
            seq = 2
        first = {"parent-without-tokens": stored_event([111]), "parent-removed": removed_event([111]),
                 "parent-cleared": cleared_event()}[case]
        before = engine_stats(cluster.target, "raw").indexed_blocks
        code, details = _code(lambda: gw.Report(pb.EngineReport(
            engine_id="raw", incarnation=inc, seq=seq,
            kv_events=[first, stored_event([222], parent=111, token_ids=toks)]), timeout=5))
        assert cluster.scheduler_proc.poll() is None
        # Accepted; the child, whose parent the scheduler cannot place, is
        # dropped and counted; the rest applied (the parent-without-tokens
        # block is indexed under its own, moelink, hash).
        assert code == OK, (code, details)
        after = engine_stats(cluster.target, "raw")
        assert after.dropped_kv_events == 1, after
        want = {"parent-without-tokens": before + 1, "parent-removed": before - 1, "parent-cleared": 0}[case]
        assert after.indexed_blocks == want, (before, after)
        ch.close()


# ---------------------------------------------------------------------- f. redirect


def _post(url, body, timeout=20):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def test_redirect_to_the_engines_http_front_end():
    """Generate(redirect=True) answers one Redirect naming a sim's HTTP URL;
    POST {address}/generate (input_ids, or the code point text) gives
    max_new_tokens output ids; streamed, the SSE chunks carry them in order
    and end with 'data: [DONE]'. What ran there is cached and indexed: the
    next redirect with that prefix goes to the same engine. Bound: 30 s."""
    rng = random.Random(13)
    tok = CodepointTokenizer()
    with LocalCluster(engines=2, http=True, time_scale=0.02) as cluster, logs_on_failure(cluster):
        settle()
        urls = {cluster.engine_id(i): cluster.http_url(i) for i in range(2)}
        prompt = rand_tokens(rng, 300)
        with SchedulerClient(cluster.target) as c:
            events = list(c.generate(prompt, max_new_tokens=12, redirect=True, request_id="redir-1", timeout=10))
            assert len(events) == 1 and events[0].HasField("redirect"), events
            rd = events[0].redirect
            assert rd.request_id == "redir-1" and rd.engine_id in urls and rd.address == urls[rd.engine_id], rd
            assert rd.expected_cached_tokens == 0
            with _post(rd.address + "/generate", {"input_ids": prompt, "rid": rd.request_id,
                                                  "sampling_params": {"max_new_tokens": 12}}) as resp:
                body = json.load(resp)
            assert body["output_ids"] == sim_tokens(prompt, 12), body
            assert body["text"] == tok.decode(body["output_ids"])
            assert body["meta_info"]["completion_tokens"] == 12 and body["meta_info"]["prompt_tokens"] == 300
            assert body["meta_info"]["finish_reason"]["type"] == "length"
            # The same prompt as code point text.
            with _post(rd.address + "/generate", {"text": tok.decode(prompt),
                                                  "sampling_params": {"max_new_tokens": 5}}) as resp:
                body = json.load(resp)
            assert body["output_ids"] == sim_tokens(prompt, 5) and body["meta_info"]["cached_tokens"] >= 288
            # Streamed.
            with _post(rd.address + "/generate", {"input_ids": prompt, "stream": True,
                                                  "sampling_params": {"max_new_tokens": 20}}) as resp:
                assert resp.headers.get("Content-Type", "").startswith("text/event-stream")
                lines = [ln.decode().rstrip("\n") for ln in resp if ln.strip()]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
            assert all(ln.startswith("data: ") for ln in lines)
            assert [t for ch in chunks for t in ch["output_ids"]] == sim_tokens(prompt, 20)
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
            assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
            # The engine published what it ran: a prompt sharing the prefix goes there.
            wait_for(lambda: engine_stats(cluster.target, rd.engine_id).indexed_blocks >= 300 // BLOCK, 10,
                     "the redirected engine's KV events")
            events = list(c.generate(prompt[:200] + [1, 2, 3], max_new_tokens=4, redirect=True, timeout=10))
            rd2 = events[0].redirect
            assert rd2.engine_id == rd.engine_id and rd2.expected_cached_tokens == 192, rd2
            assert rd2.request_id.startswith("r-")  # named by the scheduler
            # Bad bodies get 400 with a message.
            with pytest.raises(urllib.error.HTTPError) as e:
                _post(rd.address + "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 3}})
            assert e.value.code == 400 and "empty" in json.load(e.value)["error"]["message"]
            with pytest.raises(urllib.error.HTTPError) as e:
                _post(rd.address + "/generate", {"text": "ascii"})
            assert e.value.code == 400
            # Redirected requests are not tracked by the scheduler.
            s = c.stats()
            assert (s.accepted, s.requests_in_flight, s.decisions) == (0, 0, 2), s
            assert sum(e.assigned for e in s.engines) == 2
        with urllib.request.urlopen(urls[rd.engine_id] + "/health", timeout=5) as resp:
            assert resp.status == 200
        stop_and_check(cluster)


# ---------------------------------------------------------------------- g. soak


def test_soak_20s_with_kills_cancels_and_sessions():
    """8 engines; for 20 s, 24 clients submit a mix of shared-prefix and
    random prompts, some in sessions, some cancelled at a random moment;
    every 2.5 s an engine is SIGKILLed and restarted 0.4 s later. At the end
    every request has exactly one outcome (finished with its exact tokens,
    CANCELLED iff our Cancel was accepted, UNAVAILABLE only on a killed
    engine), the scheduler's counters add up (accepted == finished + failed,
    nothing in flight), and no process crashed. Bound: 20 s + 30 s drain."""
    duration = 20.0
    rng = random.Random(2024)
    prefixes = [rand_tokens(rng, n) for n in (256, 384, 512)]
    with LocalCluster(engines=8, time_scale=0.02, scheduler_args=FAST_HEARTBEAT) as cluster, \
            logs_on_failure(cluster):
        settle()
        kills = {}          # engine id -> (before, after) each kill
        restarted = []
        chaos_errors = []
        cancel_errors = []

        async def soak():
            client = AsyncSchedulerClient(cluster.target)
            cancel_ch = grpc.aio.insecure_channel(cluster.target)
            cancel_stub = pb_grpc.FrontendStub(cancel_ch)
            recs = []
            stop_at = time.monotonic() + duration
            counter = iter(range(10 ** 9))

            async def cancel_later(rec, delay):
                await asyncio.sleep(delay)
                if rec.code is not None:
                    return
                try:
                    await cancel_stub.Cancel(pb.CancelRequest(request_id=rec.rid), timeout=5)
                    rec.cancel_ok = True
                except grpc.RpcError as e:
                    rec.cancel_ok = False  # NOT_FOUND: it had ended (or was not accepted yet)
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        cancel_errors.append(f"{rec}: Cancel: {e.code().name} {e.details()}")

            async def worker(w):
                wr = random.Random(w)
                while time.monotonic() < stop_at:
                    kind = wr.random()
                    if kind < 0.5:
                        prompt = wr.choice(prefixes) + rand_tokens(wr, wr.randrange(1, 64))
                    else:
                        prompt = rand_tokens(wr, wr.randrange(16, 700))
                    session = f"sess-{wr.randrange(6)}" if wr.random() < 0.3 else ""
                    rec = Rec(prompt, wr.randrange(4, 120), rid=f"soak-{w}-{next(counter)}", session=session)
                    recs.append(rec)
                    side = None
                    if wr.random() < 0.12:
                        side = asyncio.ensure_future(cancel_later(rec, wr.uniform(0.0, 0.3)))
                    await generate(client, rec, timeout=40, stream_interval=wr.choice([0, 1, 4, 16]))
                    if side:
                        await side

            async def chaos():
                loop = asyncio.get_running_loop()
                cr = random.Random(99)
                while time.monotonic() < stop_at - 1.0:
                    await asyncio.sleep(2.5)
                    i = cr.randrange(8)
                    eid = cluster.engine_id(i)
                    before = time.monotonic()
                    try:
                        # (The kill lands some time after `before` on a busy machine.)
                        await loop.run_in_executor(None, cluster.kill_engine, i)
                        kills.setdefault(eid, []).append((before, time.monotonic()))
                        await asyncio.sleep(0.4)
                        await loop.run_in_executor(None, cluster.start_engine, i)
                        restarted.append(eid)
                    except Exception as e:  # noqa: BLE001 - reported below
                        chaos_errors.append(f"{eid}: {e!r}")

            try:
                await asyncio.gather(chaos(), *(worker(w) for w in range(24)))
            finally:
                await client.close()
                await cancel_ch.close()
            return recs

        t0 = time.monotonic()
        recs = run(soak(), duration + 30)
        elapsed = time.monotonic() - t0
        assert not chaos_errors, chaos_errors
        assert not cancel_errors, cancel_errors
        assert len(restarted) >= 4, restarted
        # Kill times stretch to the end of each request's life: a request that
        # started on an engine later killed fails, whenever the kill was.
        check_outcomes(recs, kills)
        outcomes = Counter(r.code.name for r in recs)
        assert outcomes["OK"] >= 0.7 * len(recs) and outcomes["CANCELLED"] >= 5, outcomes
        s = wait_idle(cluster, 15)
        check_counters(s)
        assert s.accepted == len(recs), (s.accepted, len(recs))
        assert s.finished == outcomes["OK"], (s, outcomes)
        assert s.failed == outcomes["CANCELLED"] + outcomes["UNAVAILABLE"], (s, outcomes)
        # Shared prefixes found cached most of the time.
        shared = [r for r in recs if r.code == OK and any(r.prompt[:len(p)] == p for p in prefixes)]
        assert sum(r.finished.cached_tokens >= 256 for r in shared) >= 0.8 * len(shared), \
            Counter(r.finished.cached_tokens >= 256 for r in shared)
        assert len({e.engine_id for e in s.engines}) == 8 and all(e.alive for e in s.engines), s
        assert cluster.scheduler_proc.poll() is None
        assert all(p.poll() is None for p in cluster.engines.values())
        with open(os.path.join(cluster.dir, "scheduler.log")) as f:
            log = f.read()
        for bad in ("error", "terminate", "abort", "Assertion", "Segmentation"):
            assert bad not in log, log[-3000:]
        assert elapsed < duration + 30
        stop_and_check(cluster)


# ---------------------------------------------------------------------- re-registration with engine-own hashes


def test_an_engine_with_own_hashes_keeps_serving_after_registering_again():
    """Bound: 20 s."""
    rng = random.Random(14)
    p = rand_tokens(rng, 320)
    with LocalCluster(engines=1, time_scale=0.02, sim_args=["--events-with-tokens"]) as cluster, \
            logs_on_failure(cluster):
        settle()
        with SchedulerClient(cluster.target) as c:
            assert c.complete(p + [1], max_new_tokens=8, timeout=10).tokens == sim_tokens(p + [1], 8)
        cluster.restart_scheduler()
        wait_for(lambda: stats(cluster.target).engines, 15, "the engine registering again")
        settle()
        # p's 20 blocks are cached at the engine; the new prompt stores a 21st
        # whose parent (block 19) the engine published before registering again.
        q = p + rand_tokens(rng, 20)
        with SchedulerClient(cluster.target) as c:
            done = c.complete(q, max_new_tokens=8, timeout=4)
        assert done.tokens == sim_tokens(q, 8) and done.cached_tokens == 320
