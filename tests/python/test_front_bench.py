"""tools/bench/front_bench.py (moelink-serve's front over a stub engine)
runs end to end, streams every token, writes a complete record and names a
bad argument."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("moelink")
pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [os.path.join(ROOT, "tools", "bench")])
    return [sys.executable, os.path.join(ROOT, "tools", "bench", "front_bench.py"), "--machine", "ci", *args], env


def test_front_bench_streams_every_token_and_records_each_round(tmp_path):
    out = tmp_path / "front.json"
    cmd, env = _cmd("--requests", "5", "--max-tokens", "12", "--step-ms", "2", "--switch-us", "5000,1000",
                    "--rounds", "2", "--json", str(out))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["tool"] == "front_bench" and rec["requests"] == 5 and rec["max_tokens"] == 12
    # Interleaved: round 1 of both settings before round 2.
    assert [(r["round"], r["switch_us"]) for r in rec["rounds"]] == [(1, 5000), (1, 1000), (2, 5000), (2, 1000)]
    for r in rec["rounds"]:
        assert 0 <= r["front_share"] < 1 and r["full_steps"] >= 3 and r["tok_s"] > 0
        # The GIL wait after a step lies inside the gap between steps.
        assert 0 <= r["gil_wait_us_p50"] <= r["gil_wait_us_p90"] and r["gil_wait_us_p50"] <= r["gap_us_p90"]
    assert [s["switch_us"] for s in rec["summary"]] == [5000, 1000]


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "--requests = 0 must be from 1 to 4096"),
    (["--step-ms", "0"], "--step-ms = 0.0 must be from 0.1 to 1000"),
    (["--switch-us", "5"], "--switch-us = '5' must name intervals from 10 to 5000 us"),
])
def test_front_bench_names_a_bad_argument(args, message):
    cmd, env = _cmd(*args)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode != 0 and message in res.stderr, res.stderr
