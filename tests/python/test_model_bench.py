"""The model benchmark's parts on the CPU path: the fp8 checkpoint it writes
(DeepSeek-V3's own layout, F8_E4M3 with 128 x 128 weight_scale_inv blocks)
loads as the values it stands for, and tools/bench/model_bench.py runs
end to end on the tiny widths and writes a complete record."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

moelink = pytest.importorskip("moelink")
from moelink.serve.tiny_model import TINY, write_fp8_checkpoint  # noqa: E402
from ranks_testlib import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEED = int(os.environ.get("MOELINK_TEST_SEED", np.random.SeedSequence().entropy % 10**6))
# One dense and two MoE layers, 256-wide (two 128 x 128 blocks a row).
FIELDS = dict(TINY, rope_scaling=None, num_hidden_layers=3, num_nextn_predict_layers=0)


def _prefill_logits(directory, ids):
    """Every row's logits of one request prefilling `ids`, on the cpu backend."""
    model = moelink.Model(f"{directory}/config.json", backend="cpu", max_tokens=len(ids), num_pages=4,
                          page_size=16, max_requests=1, max_pages_per_request=4,
                          bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0))
    model.load_checkpoint(directory)
    logits = np.full((len(ids), FIELDS["vocab_size"]), np.nan, np.float32)
    model.step(np.asarray(ids, np.int32), np.array([0, len(ids)], np.int32), np.array([len(ids)], np.int32),
               np.array([[2, 0, 3, 1]], np.int32), np.zeros(1, np.int32), logits=logits, logits_every_row=True)
    model.check()
    return logits


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_checkpoint_loads_as_the_values_it_stands_for(tmp_path):
    print(f"seed {SEED}")
    dirs = {}
    for name, kw in [("fp8", {}), ("ref", dict(dequantized=True)),
                     ("control", dict(dequantized=True, block_jitter=False))]:
        d = tmp_path / name
        d.mkdir()
        write_fp8_checkpoint(str(d), FIELDS, SEED, pool_size=1 << 16, **kw)
        dirs[name] = str(d)
    with open(f"{dirs['fp8']}/model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert weight_map["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"] == "model-layer001.safetensors"
    ids = np.random.default_rng(SEED).integers(4, FIELDS["vocab_size"], 21)
    got = _prefill_logits(dirs["fp8"], ids)
    ref = _prefill_logits(dirs["ref"], ids)
    control = _prefill_logits(dirs["control"], ids)
    assert np.isfinite(got).all()
    # The bf16 reference is quantized again at load (its own amax / 448
    # block scales, up to 1/16 relative rounding a weight) and both run on
    # fp8 activations: measured 3.0-12.2 % apart (median 4.7) over 40 seeds
    # (the 12 % bound before failed CI at seed 126797: 12.1 %). Scales
    # misplaced among the blocks (each block's is 1/2, 1 or 2 times its
    # tensor's) move the logits by tens of percent, as the control (every
    # block at one scale) shows: 39-89 % over the same seeds.
    err, err_control = _rel(got, ref), _rel(got, control)
    print(f"fp8 vs its values {err:.3f}, vs the control {err_control:.3f}")
    assert err < 0.2
    assert err_control > 3 * err


def _bench(tmp_path, *args):
    """model_bench.py's command on the tiny widths and the cpu backend (its
    checkpoints under tmp_path), with `args`; and the environment it runs in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [os.path.join(ROOT, "tools", "bench")])
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "model_bench.py"), "--tiny", "--backend", "cpu",
           "--kv", "40", "--page-size", "16", "--iters", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--machine", "ci", *args]
    return cmd, env


def test_model_bench_runs_on_the_cpu_path(tmp_path):
    out = tmp_path / "bench.json"
    cmd, env = _bench(tmp_path, "--moe-layers", "2", "--batches", "1,3", "--json", str(out),
                      "--svg", str(tmp_path / "bench.svg"))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["tool"] == "model_bench" and rec["gpu"] is None and rec["command"].startswith("model_bench.py")
    assert [s["shape"] for s in rec["shapes"]] == ["ep8", "world1"]
    for s in rec["shapes"]:
        assert s["models_layers"] == [1, 2, 4]
        assert [(r["batch"], r["q_len"]) for r in s["results"]] == [(1, 1), (3, 1), (1, 2), (3, 2)]
        for r in s["results"]:
            assert r["graph_us"] > 0 and r["tokens_per_s"] > 0 and r["step_us_full_depth"] > 0
            assert set(r["layer_us"]) == {"dense", "moe", "rest"}
            assert r["graph_replays"] == r["eager_steps"] == 0  # the CPU path has no graphs
            assert set(r["host_us_per_layer"]) == {"dense", "moe"}
    assert "B" in res.stdout and "world1" in res.stdout  # the tables
    svg = (tmp_path / "bench.svg").read_text()
    assert svg.count("ep8 B ") == 4 and svg.count("world1 B ") == 4 and "MoE layers: " in svg
    # A second run reuses the checkpoints it wrote.
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "writing a random fp8 checkpoint" not in res.stderr, res.stderr


def test_step_inputs_spread_contexts_and_shuffle_pages():
    """--kv-spread gives the step's requests contexts from kv to kv + spread;
    --shuffle-pages deals every page of the pool once, in a random order."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from model_bench import step_inputs
    x = step_inputs(FIELDS, 5, 2, 100, 4, seed=1, kv_spread=40, shuffle_pages=True)
    assert x["kv_len"].tolist() == [102, 112, 122, 132, 142]
    assert sorted(x["block_table"].ravel().tolist()) == list(range(20))
    assert x["block_table"].ravel().tolist() != list(range(20))
    plain = step_inputs(FIELDS, 1, 1, 100, 4, seed=1)
    assert plain["kv_len"].tolist() == [101] and plain["block_table"].tolist() == [[0, 1, 2, 3]]


def test_model_bench_with_spread_contexts_and_shuffled_pages(tmp_path):
    out = tmp_path / "bench.json"
    cmd, env = _bench(tmp_path, "--shapes", "ep8", "--moe-layers", "1", "--batches", "3", "--q-lens", "1",
                      "--kv-spread", "30", "--shuffle-pages", "--max-tokens", "40", "--json", str(out))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["kv_spread"] == 30 and rec["shuffle_pages"] is True and rec["max_tokens"] == 40
    for bad_max in ("2", "65537"):  # below batch x q_len, past the model's limit: named, with the range
        bad = subprocess.run(cmd[:-2] + ["--max-tokens", bad_max], capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode != 0 and f"--max-tokens {bad_max} must be from the largest batch" in bad.stderr
    assert [(r["batch"], r["q_len"]) for r in rec["shapes"][0]["results"]] == [(3, 1)]
    bad = subprocess.run(cmd[:-2] + ["--kv-spread", "-1"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "--kv-spread -1" in bad.stderr


def test_plan_prediction_names_the_gpus_profile_and_the_calibration_files(tmp_path):
    """plan_us runs moelink-plan on the profile the GPU's name names (the H100
    runs had used h200's), with each --plan-calibrate file as --calibrate, and
    passes its notes on; a failing plan gives None. A stand-in binary records
    its arguments."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from model_bench import plan_gpu_of, plan_us
    assert plan_gpu_of("NVIDIA H100 80GB HBM3") == "h100" and plan_gpu_of("NVIDIA H200") == "h200"
    assert plan_gpu_of("NVIDIA H800") == "h800" and plan_gpu_of("NVIDIA A100-SXM4-80GB") is None
    assert plan_gpu_of(None) is None
    args = tmp_path / "args.txt"
    fake = tmp_path / "moelink-plan"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {args}\n"
                    "echo 'note: --calibrate layer.json does not apply to EP8' >&2\n"
                    "echo '{\"moe_layer\": {\"total_us\": 900}, \"dense_layer\": {\"total_us\": 600},"
                    " \"head_us\": 1000, \"step_us\": 60000}'\n")
    fake.chmod(0o755)
    p = plan_us(str(fake), "h100", ["layer.json", "bench.json"], "ep8", 128, 2, 5000, 0.8)
    argv = args.read_text().split()
    assert argv[argv.index("--gpu") + 1] == "h100" and argv[argv.index("--ep") + 1] == "8"
    assert argv[argv.index("--mtp") + 1] == "1" and argv[argv.index("--batch") + 1] == "128"
    assert [argv[i + 1] for i, v in enumerate(argv) if v == "--calibrate"] == ["layer.json", "bench.json"]
    assert (p["moe"], p["dense"], p["head"], p["step"], p["gpu"]) == (900, 600, 1000, 60000, "h100")
    assert "does not apply" in p["notes"]
    fake.write_text("#!/bin/sh\necho 'moelink-plan: --gpu: unknown gpu' >&2\nexit 2\n")
    assert plan_us(str(fake), "h100", [], "world1", 1, 1, 5000, 0.8) is None
    # The command line refuses a profile moelink-plan lacks and a missing calibration file, by name.
    fake.write_text("#!/bin/sh\nexit 0\n")
    for extra, message in ((["--plan-gpu", "a100"], "--plan-gpu 'a100': one of h100, h200, h800"),
                           (["--plan-calibrate", str(tmp_path / "none.json")], "none.json: no such file")):
        cmd, env = _bench(tmp_path, "--plan", str(fake), *extra)
        bad = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode != 0 and message in bad.stderr, bad.stderr


def test_moe_layer_floors_by_hand():
    """The MoE layer's floors on DeepSeek-V3's widths at one EP8 rank's
    shape (32 experts, top 8), 128 requests of q_len 2 on kv 5000, against
    the bytes and FLOPs counted here term by term; the serial floor (its
    kernels one after another) is never below the issue's floor."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from model_bench import moe_layer_floor_us, moe_layer_serial_floor_us
    from moelink.serve.tiny_model import DEEPSEEK_V3
    f = dict(DEEPSEEK_V3, n_routed_experts=32)
    b, q, kv, bw_gbs, fp8, bf16 = 128, 2, 5000, 3000.0, 1400.0, 700.0
    n = b * q
    attn_w = 7168 * (1536 + 512 + 64) + 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    touched = 32 * (1 - (1 - 8 / 32) ** n)  # all 32, to 1e-30
    weight_bytes = attn_w + (touched + 1) * 3 * 7168 * 2048 + 32 * 7168 * 2
    kv_bytes = b * (kv + q) * 576 * 2
    weight_flops = 2 * n * (attn_w + 9 * 3 * 7168 * 2048)
    attn_flops = 2 * n * 128 * (kv + q) * (512 + 576)
    floor, nbytes, flops = moe_layer_floor_us(f, b, q, kv, bw_gbs, fp8)
    assert nbytes == pytest.approx(weight_bytes + kv_bytes) and flops == pytest.approx(weight_flops + attn_flops)
    assert floor == pytest.approx((weight_bytes + kv_bytes) / (bw_gbs * 1e3))  # bytes-bound here
    serial = moe_layer_serial_floor_us(f, b, q, kv, bw_gbs, fp8, bf16)
    # Attention FLOP-bound at the bf16 peak, the weights bytes-bound.
    assert serial == pytest.approx(attn_flops / (bf16 * 1e6) + weight_bytes / (bw_gbs * 1e3))
    assert serial > floor
    # One request of q_len 1 on a bf16 peak that leaves its attention
    # bytes-bound too (241.8 FLOPs a cache byte at 128 heads, under 800 /
    # 3 = 267): the serial floor is then the same bytes as the floor.
    floor1, _, _ = moe_layer_floor_us(f, 1, 1, kv, bw_gbs, fp8)
    assert moe_layer_serial_floor_us(f, 1, 1, kv, bw_gbs, fp8, 800.0) == pytest.approx(floor1)
    # ... and FLOP-bound at 700 (233 FLOPs a byte): above the floor by the difference.
    kv1, af1 = (kv + 1) * 576 * 2, 2 * 128 * (kv + 1) * (512 + 576)
    assert moe_layer_serial_floor_us(f, 1, 1, kv, bw_gbs, fp8, 700.0) == pytest.approx(
        floor1 - kv1 / (bw_gbs * 1e3) + af1 / (700.0 * 1e6))
