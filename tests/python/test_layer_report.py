"""tools/bench/layer_report.py without a GPU: the kernel-to-stage assignment
of layer_bench.py on the kernel sequences a forward launches in each mode,
and the tables and chart on a small hand-made result file."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))

import layer_report  # noqa: E402

QUANT = "void moelink::detail::experts::(anonymous namespace)::group_quant_kernel<(moelink::detail::experts::GroupQuantInput)0>(x)"
SILU = "void moelink::detail::experts::(anonymous namespace)::group_quant_kernel<(moelink::detail::experts::GroupQuantInput)1>(x)"
ARGS = "void moelink::detail::experts::write_group_arguments<...>(x)"
GEMM = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversal"
GATE = "nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT"
ROUTER = "moelink::detail::layer::(anonymous namespace)::router_kernel(float const*, long)"
SEND = "void moelink::detail::(anonymous namespace)::dispatch_kernel<true, false>(p)"
RECV = "void moelink::detail::(anonymous namespace)::dispatch_kernel<false, true>(p)"
CSEND = "void moelink::detail::(anonymous namespace)::combine_kernel<__nv_bfloat16, __nv_bfloat16, true, false>(p)"
CRECV = "void moelink::detail::(anonymous namespace)::combine_kernel<__nv_bfloat16, __nv_bfloat16, false, true>(p)"
COPY = "moelink::detail::layer::(anonymous namespace)::copy_rows_kernel(char*)"
SHARED = [ARGS, GEMM, SILU, ARGS, GEMM]
ROUTED = [ARGS, GEMM, SILU, ARGS, GEMM]


def test_stages_mode_none_two_forwards_in_a_graph():
    one = [COPY, QUANT, GATE, ROUTER] + SHARED + [SEND, RECV] + ROUTED + [CSEND, CRECV, COPY]
    want = (["other_us", "quantize_us", "router_us", "router_us"] + ["shared_expert_us"] * 5 +
            ["dispatch_send_us", "dispatch_recv_us", "gemm1_us", "gemm1_us", "silu_mul_us",
             "gemm2_us", "gemm2_us", "combine_send_us", "combine_recv_us", "other_us"])
    assert layer_report.stage_of_kernels(one + one) == want + want


def test_stages_dispatch_overlap_puts_the_shared_expert_after_the_send():
    seq = [QUANT, GATE, ROUTER, SEND] + SHARED + [RECV] + ROUTED + [CSEND, CRECV]
    got = layer_report.stage_of_kernels(seq)
    assert got[3] == "dispatch_send_us"
    assert got[4:9] == ["shared_expert_us"] * 5
    assert got[9] == "dispatch_recv_us"
    assert got[10:15] == ["gemm1_us", "gemm1_us", "silu_mul_us", "gemm2_us", "gemm2_us"]


def test_stages_without_shared_expert():
    seq = [QUANT, GATE, ROUTER, SEND, RECV] + ROUTED + [CSEND, CRECV]
    got = layer_report.stage_of_kernels(seq)
    assert "shared_expert_us" not in got
    assert got.count("silu_mul_us") == 1


def _sample(tmp_path):
    stages = dict.fromkeys(layer_report.STAGES, 1.0)
    stages["gemm1_us"] = 100.0
    rec = {"tool": "tools/bench/layer_bench.py", "machine": "test", "date": "2026-12-02T00:00:00+00:00",
           "gpu": "none", "git_commit": "0000000", "world_size": 1, "copy_gbs": 4000.0,
           "model": {"name": "DeepSeek-V3", "preset": "deepseek-v3", "hidden_size": 7168},
           "results": [{"batch": b, "mode": "none", "graphs": g, "wall_us": 130.0, "floor_us": 100.0,
                        "wall_over_floor": 1.3, "sum_of_kernels_us": 120.0, "busy_us": 119.0,
                        "wall_over_kernels": 130 / 120, "stages_us": stages,
                        **({} if g else {"stage_marks_us": dict(stages, router_us=40.0)})}
                       for b in (1, 128) for g in (False, True)]}
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(rec))
    return path


def test_report_tables_and_svg(tmp_path, capsys, monkeypatch):
    path = _sample(tmp_path)
    svg = tmp_path / "layer.svg"
    monkeypatch.setattr(sys, "argv", ["layer_report.py", str(path), "--svg", str(svg)])
    layer_report.main()
    out = capsys.readouterr().out
    assert "  128 none             graph    130.0    120.0" in out
    assert "gpu" in out and "marks" in out
    text = svg.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert "GEMM1: 100.0 us" in text and "128 tokens" in text


def test_report_with_a_broken_planner_still_reports(tmp_path, capsys, monkeypatch):
    path = _sample(tmp_path)
    monkeypatch.setattr(sys, "argv", ["layer_report.py", str(path), "--plan", "/bin/false"])
    layer_report.main()
    captured = capsys.readouterr()
    assert "failed" in captured.err
    assert " plan  " not in captured.out  # no prediction rows


@pytest.mark.parametrize("bad", ["not json", "{}"])
def test_report_rejects_a_file_that_is_not_layer_bench_output(tmp_path, monkeypatch, bad):
    path = tmp_path / "bad.json"
    path.write_text(bad)
    monkeypatch.setattr(sys, "argv", ["layer_report.py", str(path)])
    with pytest.raises(SystemExit) as e:
        layer_report.main()
    assert "layer_report" in str(e.value)


def test_exclusive_times_count_each_busy_instant_once():
    """benchlib.exclusive_us, which stages_us and the profiles' exclusive
    times come from: a kernel launched early under programmatic dependent
    launch (SiLU below) gets only its time past its predecessor's end; a
    kernel under a longer one on another stream gets nothing; gaps are no
    one's. Random spans: the shares add up to the union's length."""
    import random

    import benchlib
    spans = [(0.0, 100.0, GEMM), (5.0, 102.0, SILU), (102.0, 150.0, GEMM), (110.0, 120.0, SHARED[0]),
             (160.0, 170.0, CSEND)]
    assert benchlib.exclusive_us(spans) == [100.0, 2.0, 48.0, 0.0, 10.0]
    p = benchlib.span_profile(spans, iters=2)
    assert p["busy_us"] == pytest.approx(80.0) and p["sum_of_kernels_us"] == pytest.approx(132.5)
    by = {k["name"]: k for k in p["kernels"]}
    assert by[GEMM[:160]]["exclusive_us"] == pytest.approx(74.0) and by[GEMM[:160]]["calls"] == 1.0
    assert by[SILU[:160]]["us"] == pytest.approx(48.5) and by[SILU[:160]]["exclusive_us"] == pytest.approx(1.0)
    assert [k["name"] for k in p["kernels"]][0] == GEMM[:160]  # largest exclusive first
    rng = random.Random()
    for _ in range(50):
        n = rng.randint(0, 12)
        sp = sorted((t0, t0 + rng.uniform(0, 30), "k%d" % rng.randint(0, 3))
                    for t0 in (rng.uniform(0, 100) for _ in range(n)))
        union, end = 0.0, float("-inf")
        for t0, t1, _ in sp:  # the union's length, computed apart
            if t1 > end:
                union += t1 - max(t0, end)
                end = t1
        x = benchlib.exclusive_us(sp)
        assert all(v >= 0 for v in x) and sum(x) == pytest.approx(union)
        assert all(v <= t1 - t0 + 1e-9 for v, (t0, t1, _) in zip(x, sp))
