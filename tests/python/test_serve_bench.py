"""tools/bench/serve_bench.py on the CPU path: it starts moelink-serve on the
tiny model with and without prefix caching, sends both traces at two
concurrencies, and every request completes; the prefix cache's hits show
where it is on and are zero where it is off; the server's step metrics
come through."""

import json
import os
import subprocess
import sys

import pytest

moelink = pytest.importorskip("moelink")
pytest.importorskip("ml_dtypes")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.skipif(not moelink._C.with_engine, reason="this build has no engine (xxHash)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [os.path.join(ROOT, "tools", "bench")])
    return env


def test_serve_bench_loads_the_server_with_and_without_prefix_caching(tmp_path):
    from moelink.serve.tiny_model import write_tiny_model
    write_tiny_model(str(tmp_path), layers=2, seed=3)
    out = tmp_path / "serve.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "serve_bench.py"), "--model", str(tmp_path),
           "--serve-args", "--num-pages 64 --page-size 16 --max-running 4 --token-budget 64",
           "--concurrency", "1,3", "--requests", "8", "--context", "160", "--max-tokens", "4",
           "--machine", "ci", "--server-log", str(tmp_path / "server.log"), "--json", str(out),
           "--svg", str(tmp_path / "serve.svg")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["tool"] == "serve_bench" and rec["command"].startswith("serve_bench.py")
    cells = {(c["trace"], c["prefix_caching"], c["concurrency"]): c for c in rec["cells"]}
    assert sorted(cells) == sorted((t, p, c) for t in ("shared-prefix", "multi-turn") for p in ("on", "off")
                                   for c in (1, 3))
    for key, c in cells.items():
        n = max(8, 4 * key[2]) if key[0] == "multi-turn" else 8  # C sessions of 4 turns at least
        assert c["errors"] == 0 and c["completed"] == c["requests"] == n, (key, c["error_examples"])
        assert c["output_tokens"] == n * 4, key  # ignore_eos: every request its max_tokens
        assert c["ttft_ms"]["p50"] > 0 and c["itl_ms"]["p50"] > 0 and c["output_tok_s"] > 0
        s = c["server"]
        assert s["decode_step_us"] > 0 and 1 <= s["decode_batch"] <= 3 and 0 <= s["overhead_share"] < 1
        assert s["decode_tok_s"] == pytest.approx(s["decode_batch"] / s["decode_step_us"] * 1e6)
        assert s["graph_replays"] == s["graph_eager_steps"] == 0, key  # the CPU path: no graphs
        if key[1] == "off":
            assert c["cached_share"] == 0, key
        elif key[:3] == ("shared-prefix", "on", 1):
            # One after another, the group's 7 later prompts find its 120-token
            # system prompt's 7 full pages: 7 x 112 of 8 x 160 prompt tokens.
            assert c["cached_share"] == pytest.approx(7 * 112 / (8 * 160)), key
        else:  # the first requests of a group (or session) in flight together miss
            assert c["cached_share"] > 0.1, key
    svg = (tmp_path / "serve.svg").read_text()
    assert svg.count("TTFT p50, ms") == 4 and svg.count(">cache off<") == 12 and "output tok/s" in svg


def test_serve_bench_runs_a_cell_per_rate_and_concurrency(tmp_path):
    """--rate 0,40: a closed-loop cell and one of Poisson arrivals at 40/s
    per concurrency, each with every request completed and its rate
    recorded; the arrivals at 40/s spread the cell's 8 requests (the last
    one starts after the rate's expected span, with the seed's draws)."""
    from moelink.serve.tiny_model import write_tiny_model
    write_tiny_model(str(tmp_path), layers=2, seed=4)
    out = tmp_path / "serve.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "serve_bench.py"), "--model", str(tmp_path),
           "--serve-args", "--num-pages 64 --page-size 16 --max-running 4 --token-budget 64",
           "--cache", "on", "--traces", "shared-prefix", "--rate", "0,40", "--concurrency", "2",
           "--requests", "8", "--context", "160", "--max-tokens", "4", "--machine", "ci",
           "--json", str(out), "--svg", str(tmp_path / "serve.svg")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["rates_per_s"] == [0.0, 40.0]
    assert [(c["rate_per_s"], c["concurrency"]) for c in rec["cells"]] == [(0.0, 2), (40.0, 2)]
    for c in rec["cells"]:
        assert c["errors"] == 0 and c["completed"] == c["requests"] == 8, c["error_examples"]
    import random
    rng = random.Random(1)  # run_cell's draws with the default --seed 1
    last_start = sum(rng.expovariate(40.0) for _ in range(8))
    assert rec["cells"][1]["wall_s"] >= last_start
    assert "C 2 at 40/s: TTFT p50, ms" in (tmp_path / "serve.svg").read_text()


@pytest.mark.parametrize("rate", ["fast", "-1", ","])
def test_serve_bench_refuses_a_bad_rate(rate):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "serve_bench.py"), "--url",
           "http://127.0.0.1:9/v1", "--vocab", "512", "--rate", rate]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 2 and "--rate" in res.stderr and "arrivals per second" in res.stderr


def test_serve_bench_refuses_a_url_without_the_vocabulary():
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "serve_bench.py"), "--url",
           "http://127.0.0.1:9/v1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 2 and "--url needs --vocab" in res.stderr


def test_multi_turn_requests_spread_over_count_over_4_sessions():
    """trace_requests gives every session its first turn before any its
    second (so count // 4 sessions can be in flight at once), each session's
    prompts growing in order, `count` requests in all."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from serve_bench import trace_requests
    for count in (1, 7, 64, 256):
        sessions = trace_requests("multi-turn", count, 5000, 1000, 8, seed=count)
        assert sum(len(s) for s in sessions) == count
        assert len(sessions) == max(1, count // 4), count
        for s in sessions:
            for a, b in zip(s, s[1:]):
                assert len(b) > len(a) and b[:len(a)] == a  # the earlier prompt, then the new turn
            assert all(4 <= t < 1000 for p in s for t in p) and len(s[-1]) <= 5000
