"""Tests of the moelink Python bindings.

CPU tests: 1 process (errors), or 2 / 4 processes (spawn context) joined by a
moelink.TcpBootstrap on a free loopback port, backend="cpu", numpy arrays,
results compared with an independent numpy reference (below).

GPU test: torch + >= 2 CUDA devices, backend="nvlink" over a
torch.distributed process group; skipped elsewhere.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import numpy as np
import pytest

import moelink
import ranks_testlib
from ranks_testlib import free_port

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


# --------------------------------------------------------------------------
# helpers


def unit_roundoff(dtype_name: str) -> float:
    return {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype_name]


def np_out_dtype(name: str):
    if name == "float16":
        return np.float16
    assert ml_dtypes is not None
    return ml_dtypes.bfloat16


# --------------------------------------------------------------------------
# independent numpy reference
#
# Every rank generates every DP group's inputs from the same seed, so each can
# compute the expected result for its own experts and its own group.


def make_group_inputs(cfg: dict, seed: int, group: int, m: int, kind: str):
    """Inputs of one DP group: x [T, H], scale [T, S] or None, idx [T, k]
    int64 (-1 = no route), w [T, k] fp32."""
    T, H, k = cfg["max_num_tokens"], cfg["hidden_dim"], cfg["experts_per_token"]
    E, S = cfg["num_experts"], cfg["hidden_dim_scale"]
    rng = np.random.default_rng([seed, group])
    idx = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64)
    idx[rng.random((T, k)) < 0.15] = -1  # some "no route" slots
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    if kind == "fp8":
        x = rng.integers(0, 256, size=(T, H), dtype=np.uint8)  # raw bytes
        scale = rng.uniform(0.5, 2.0, size=(T, S)).astype(np.float32)
    else:
        x = rng.uniform(-1.0, 1.0, size=(T, H)).astype(np.float32)
        scale = None
    return x, scale, idx, w


def group_m(cfg: dict, seed: int, group: int, rnd: int) -> int:
    T = cfg["max_num_tokens"]
    rng = np.random.default_rng([seed, group, rnd, 7])
    return int(rng.integers(1, T + 1)) if rnd % 2 else T


def expected_dispatch(cfg, rank, groups):
    """groups[g] = (x, scale, idx, w, m). Returns, per local expert, the
    sorted list of (token bytes [+ scale bytes]) it must receive."""
    W, E = cfg["world_size"], cfg["num_experts"]
    L = E // W
    out = []
    for j in range(L):
        e = rank * L + j
        rows = []
        for x, scale, idx, _w, m in groups:
            for t in range(m):
                if e in idx[t]:
                    key = x[t].tobytes() + (scale[t].tobytes() if scale is not None else b"")
                    rows.append(key)
        out.append(sorted(rows))
    return out


def expert_fn(e: int, x_row_f32: np.ndarray, scale_row, kind: str, H: int) -> np.ndarray:
    """What the test's fake expert e computes from one received row (fp32)."""
    if kind == "fp8":
        return np.full(H, scale_row[0] * (e + 1), dtype=np.float32)
    return x_row_f32 * np.float32(e + 1)


def expected_combine(cfg, x, scale, idx, w, m, kind, out_name, base=None):
    """out[t] for t < m, in float64, from the expert outputs rounded to
    out_dtype as the expert writes them; plus the bound sum(|terms|)."""
    T, H, E = cfg["max_num_tokens"], cfg["hidden_dim"], cfg["num_experts"]
    odt = np_out_dtype(out_name)
    ref = np.zeros((m, H), np.float64)
    mag = np.zeros((m, H), np.float64)
    for t in range(m):
        for i in range(idx.shape[1]):
            e = int(idx[t, i])
            if e < 0 or e >= E:
                continue
            xr = x[t].astype(np.float32) if kind != "fp8" else None
            y = expert_fn(e, xr, scale[t] if scale is not None else None, kind, H)
            y = y.astype(odt).astype(np.float64)
            ref[t] += float(w[t, i]) * y
            mag[t] += abs(float(w[t, i]) * y)
    if base is not None:
        ref += base[:m].astype(np.float64)
        mag += np.abs(base[:m].astype(np.float64))
    return ref, mag


# --------------------------------------------------------------------------
# scenarios (run in each rank's process)


def _index_view(idx: np.ndarray, which: int, k: int):
    """The int64 route table as int32 / uint32 / int64, in a strided view."""
    T = idx.shape[0]
    if which == 0:
        big = np.full((T, 2 * k), 12345, np.int32)
        big[:, ::2] = idx.astype(np.int32)
        return big[:, ::2]  # stride 2
    if which == 1:
        return np.ascontiguousarray(idx.astype(np.int64).astype(np.uint32))  # -1 -> 0xffffffff
    return np.asfortranarray(idx)  # int64, column-major


def scenario_roundtrip(rank, world_size, bs, cfg_kw, kind, rounds=4, seed=1234, backend="cpu",
                       backend_kw=None):
    cfg = dict(cfg_kw, rank=rank, world_size=world_size)
    in_name = {"fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3"}[kind]
    out_name = cfg["out_dtype"]
    config = moelink.Config(**dict(cfg, in_dtype=in_name))
    cfg["hidden_dim_scale"] = config.hidden_dim_scale
    a2a = moelink.AllToAll(config, backend=backend, bootstrap=bs, timeout_s=20.0,
                           **(backend_kw or {}))
    assert a2a.config == config and a2a.backend == backend and a2a.buffer_bytes > 0
    T, H, k = config.max_num_tokens, config.hidden_dim, config.experts_per_token
    S, L, C = config.hidden_dim_scale, config.num_local_experts, config.expert_capacity
    D = config.dp_size
    G = world_size // D
    g_me = rank // D
    x_np = {"fp16": np.float16, "fp8": np.uint8,
            "bf16": ml_dtypes.bfloat16 if ml_dtypes else None}[kind]
    odt = np_out_dtype(out_name)

    for rnd in range(rounds):
        groups = []
        for g in range(G):
            x, scale, idx, w = make_group_inputs(cfg, seed + rnd, g, T, kind)
            if kind != "fp8":
                x = x.astype(x_np)  # what is sent (rounded to in_dtype)
            groups.append((x, scale, idx, w, group_m(cfg, seed, g, rnd)))
        x, scale, idx, w, m = groups[g_me]

        # This rank's inputs; dp_x has exactly m rows in round 3 (T' < T).
        rows = m if rnd == 3 else T
        dp_x = np.ascontiguousarray(x[:rows])
        dp_x_scale = None if scale is None else np.asfortranarray(scale[:rows])
        indices = _index_view(idx, rnd % 3, k)[:rows]
        weights = np.ascontiguousarray(w.T).T[:rows]  # column-major
        bound_m = np.array([m], np.int32)

        num = np.full(L, -7, np.int32)
        out_x = np.zeros((L, C, H), x_np)
        out_s = None if S == 0 else np.zeros((L, S, C), np.float32).transpose(0, 2, 1)

        split = rnd == 2
        args = (num, out_x, out_s, dp_x, dp_x_scale, indices, weights, bound_m)
        if split:
            a2a.dispatch(*args, do_recv=False)
            a2a.dispatch(*args, do_send=False)
        else:
            a2a.dispatch(*args)
        a2a.check()

        exp = expected_dispatch(cfg, rank, groups)
        for j in range(L):
            assert num[j] == len(exp[j]), (rnd, j, num[j], len(exp[j]))
            got = sorted(
                out_x[j, r].tobytes() + (out_s[j, r].tobytes() if out_s is not None else b"")
                for r in range(num[j]))
            assert got == exp[j], f"round {rnd}: local expert {j}: received rows differ"

        # Fake experts: y = f_e(row) for the rows dispatch wrote.
        expert_y = np.zeros((L, C, H), odt)
        for j in range(L):
            e = rank * L + j
            for r in range(num[j]):
                xr = out_x[j, r].astype(np.float32) if kind != "fp8" else None
                sr = out_s[j, r] if out_s is not None else None
                expert_y[j, r] = expert_fn(e, xr, sr, kind, H).astype(odt)

        accumulate = rnd == 1
        sentinel = 3.0
        out = np.full((T, H), sentinel, np.float32).astype(odt)
        base = out.astype(np.float32) if accumulate else None
        cargs = (out[:rows], indices, weights, expert_y, bound_m)
        if split:
            a2a.combine(*cargs, do_recv=False)
            a2a.combine(*cargs, do_send=False)
        else:
            a2a.combine(*cargs, accumulate=accumulate)
        a2a.check()

        ref, mag = expected_combine(cfg, x, scale, idx, w, m, kind, out_name, base)
        got = out[:m].astype(np.float64)
        tol = 3 * unit_roundoff(out_name) * mag + 1e-6
        bad = np.abs(got - ref) > tol
        assert not bad.any(), (
            f"round {rnd}: combine differs at {np.argwhere(bad)[:5].tolist()}: "
            f"got {got[bad][:5]}, want {ref[bad][:5]}")
        assert (out[m:].astype(np.float32) == sentinel).all(), "rows >= m were written"
        if (backend_kw or {}).get("profile"):
            times = a2a.phase_times()
            assert set(times) == {"dispatch", "combine"}, times
            for phase in times.values():
                assert set(phase) == {"pack_us", "post_us", "wire_us", "unpack_us"}, phase
                assert all(v > 0 for v in phase.values()), times
    a2a.close()
    assert a2a.closed


def scenario_timeout(rank, world_size, bs):
    cfg = dict(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=16,
               in_dtype="fp16", out_dtype="fp16", rank=rank, world_size=world_size)
    a2a = moelink.AllToAll(backend="cpu", bootstrap=bs, timeout_s=1.0, **cfg)
    if rank == 0:
        L, C = a2a.config.num_local_experts, a2a.config.expert_capacity
        x = np.zeros((4, 16), np.float16)
        idx = np.zeros((4, 2), np.int32)
        idx[:, 1] = 3
        # The GIL is released while dispatch waits for the missing peer.
        import threading
        ticks, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        th = threading.Thread(target=spin)
        th.start()
        t0 = time.monotonic()
        a2a.dispatch(np.zeros(L, np.int32), np.zeros((L, C, 16), np.float16), None, x, None,
                     idx, np.ones((4, 2), np.float32), np.array([4], np.int32))
        stop.set()
        th.join()
        assert ticks[0] > 100, f"GIL held during dispatch? only {ticks[0]} ticks in 1 s"
        with pytest.raises(moelink.TimeoutError) as ei:
            a2a.check()
        assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, moelink.Error)
        assert "rank 1" in str(ei.value), str(ei.value)
        assert time.monotonic() - t0 < 15
    bs.barrier()  # rank 1 stays until rank 0 is done


SCENARIOS = {
    "roundtrip": scenario_roundtrip,
    "timeout": scenario_timeout,
}


def run_ranks(world_size: int, scenario: str, timeout: float = 60.0, **kwargs):
    ranks_testlib.run_ranks(world_size, SCENARIOS[scenario], timeout, **kwargs)


# --------------------------------------------------------------------------
# multi-process CPU tests

BASE = dict(max_num_tokens=24, num_experts=8, experts_per_token=3, hidden_dim=32,
            out_dtype="float16")


@pytest.mark.parametrize("world_size,dp_size,kind", [
    (2, 1, "fp16"),
    (2, 1, "fp8"),
    (4, 2, "fp16"),
    (4, 2, "fp8"),
])
def test_roundtrip_cpu(world_size, dp_size, kind):
    cfg = dict(BASE, dp_size=dp_size)
    if kind == "fp8":
        cfg["hidden_dim_scale"] = 2
    run_ranks(world_size, "roundtrip", cfg_kw=cfg, kind=kind)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes for numpy bfloat16")
def test_roundtrip_cpu_bf16():
    cfg = dict(BASE, out_dtype="bfloat16")
    run_ranks(2, "roundtrip", cfg_kw=cfg, kind="bf16", rounds=2)


def test_timeout_cpu():
    run_ranks(2, "timeout")


@pytest.mark.skipif(not moelink._C.with_fabric, reason="moelink was built without libfabric")
@pytest.mark.parametrize("world_size,dp_size,kind,node_size",
                         [(4, 1, "fp16", 1), (4, 2, "fp8", 1), (4, 2, "fp16", 2)])
def test_roundtrip_internode_cpu(world_size, dp_size, kind, node_size):
    """The inter-node protocol with CPU loops over libfabric's shm provider
    (node_size 2: two ranks per node exchange tokens through shared memory)."""
    cfg = dict(BASE, dp_size=dp_size)
    if kind == "fp8":
        cfg["hidden_dim_scale"] = 2
    run_ranks(world_size, "roundtrip", cfg_kw=cfg, kind=kind, backend="internode-cpu",
              backend_kw=dict(fabric_provider="shm", max_private_tokens=2, profile=True,
                              fabric_nics=dp_size, node_size=node_size))


# --------------------------------------------------------------------------
# single-process tests (world_size 1)


SMALL = dict(max_num_tokens=8, num_experts=4, experts_per_token=2, hidden_dim=16,
             in_dtype="float16", out_dtype="float16")


def single(**kw):
    bs = moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 10.0)
    cfg = dict(SMALL, **kw)
    return moelink.AllToAll(backend="cpu", bootstrap=bs, timeout_s=5.0, **cfg)


def buffers(a2a, T=None, idx=None, x_dtype=np.float16):
    c = a2a.config
    T = T or c.max_num_tokens
    L, C, H, k, S = (c.num_local_experts, c.expert_capacity, c.hidden_dim,
                     c.experts_per_token, c.hidden_dim_scale)
    rng = np.random.default_rng(0)
    if idx is None:
        idx = np.stack([rng.choice(c.num_experts, k, replace=False) for _ in range(T)])
    b = dict(
        out_expert_num_tokens=np.zeros(L, np.int32),
        out_expert_x=np.zeros((L, C, H), x_dtype),
        out_expert_x_scale=None if S == 0 else np.zeros((L, C, S), np.float32),
        dp_x=rng.uniform(-1, 1, (T, H)).astype(np.float32).astype(x_dtype),
        dp_x_scale=None if S == 0 else np.ones((T, S), np.float32),
        indices=np.asarray(idx, np.int32),
        weights=np.full((T, k), 0.5, np.float32),
        bound_m=np.array([T], np.int32),
    )
    return b


def combine_args(a2a, b):
    c = a2a.config
    return dict(out_tokens=np.zeros((c.max_num_tokens, c.hidden_dim), np.float16),
                indices=b["indices"], weights=b["weights"],
                expert_y=np.zeros((c.num_local_experts, c.expert_capacity, c.hidden_dim),
                                  np.float16),
                bound_m=b["bound_m"])


def _run_in_fresh_python(code, **env_overrides):
    import subprocess
    import sys
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(moelink.__file__)))
    env = dict(os.environ, **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_import_without_torch():
    _run_in_fresh_python("import sys, moelink; "
                         "assert 'torch' not in sys.modules, 'moelink imported torch'; print('ok')")


def test_sglang_plugin_imports_nothing_when_off():
    # SGLang calls the entry point in every process it starts; switched off
    # it must not import SGLang's modules, torch or moelink's integration.
    _run_in_fresh_python(
        "import sys, moelink.integrations as mi; mi.sglang_plugin(); "
        "loaded = [m for m in ('sglang', 'torch', 'moelink.integrations.sglang') if m in sys.modules]; "
        "assert not loaded, loaded; print('ok')", MOELINK_SGLANG="0")


def test_exception_hierarchy():
    assert issubclass(moelink.InvalidArgument, ValueError)
    assert issubclass(moelink.InvalidArgument, moelink.Error)
    assert issubclass(moelink.InputError, moelink.Error)
    assert issubclass(moelink.TimeoutError, TimeoutError)
    assert issubclass(moelink.TimeoutError, moelink.Error)
    assert issubclass(moelink.SystemError, moelink.Error)
    assert issubclass(moelink.Error, RuntimeError)


def test_config_fields_and_dtypes():
    c = moelink.Config(max_num_tokens=128, num_experts=256, experts_per_token=8,
                       hidden_dim=7168, hidden_dim_scale=56, in_dtype="fp8", out_dtype="bf16",
                       rank=1, world_size=8, dp_size=2)
    assert c.in_dtype == "float8_e4m3" and c.out_dtype == "bfloat16"
    assert (c.num_local_experts, c.num_dp_groups, c.dp_group, c.expert_capacity) == \
        (32, 4, 0, 512)
    c.validate()
    for spelling, want in [("float8_e4m3", "float8_e4m3"), ("fp8", "float8_e4m3"),
                           ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
                           ("float16", "float16"), ("fp16", "float16"),
                           (np.float16, "float16"), (np.dtype("float16"), "float16")]:
        c.in_dtype = spelling
        assert c.in_dtype == want, spelling
    if ml_dtypes is not None:
        c.in_dtype = ml_dtypes.float8_e4m3fn
        assert c.in_dtype == "float8_e4m3"
        c.out_dtype = ml_dtypes.bfloat16
        assert c.out_dtype == "bfloat16"
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.copy(c) == c and "Config(" in repr(c)

def test_config_compare_and_pickle_state():
    kw = dict(SMALL, rank=1, world_size=2, dp_size=2)
    c = moelink.Config(**kw)
    # Other types compare unequal (NotImplemented), they do not raise.
    assert c != None and not (c == None) and c != 3 and c != "Config"  # noqa: E711
    assert c == moelink.Config(**kw) and c != moelink.Config(**dict(kw, rank=0))
    import pickle
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        d = pickle.loads(pickle.dumps(c, protocol=proto))
        assert d == c and d is not c and repr(d) == repr(c), proto
    assert c.__getstate__() == (8, 4, 2, 16, 0, "float16", "float16", 1, 2, 2)
    # A malformed state is refused (nanobind's tuple indexing is unchecked).
    blank = moelink.Config.__new__(moelink.Config)
    state = c.__getstate__()
    for bad in [(), (1, 2), state + (0,), list(state), None]:
        with pytest.raises(TypeError, match="__setstate__"):
            blank.__setstate__(bad)
    with pytest.raises(ValueError, match="in_dtype"):
        blank.__setstate__(state[:5] + ("float99",) + state[6:])
    blank.__setstate__(state)
    assert blank == c


def _echo_config(cfg, q):
    q.put((cfg, repr(cfg), cfg.num_local_experts))


def test_config_pickles_to_spawned_process():
    c = moelink.Config(**dict(SMALL, in_dtype="fp8", hidden_dim_scale=2, rank=1, world_size=2))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_echo_config, args=(c, q), daemon=True)
    p.start()
    got = None
    deadline = time.monotonic() + 60
    try:
        while got is None and time.monotonic() < deadline:
            try:
                got = q.get(timeout=0.5)
            except queue.Empty:
                if p.exitcode is not None:
                    break
        p.join(timeout=10)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert got is not None, f"child exited with {p.exitcode} and sent nothing"
    back, text, local_experts = got
    assert back == c and text == repr(c) and local_experts == 2


# moelink._C formats numbers through C++ iostreams (Config repr, every error
# message, the CPU backend's setup). If the module carries its own libstdc++
# (a toolchain that links it statically) and exports it, the locale facet ids
# (GNU unique symbols) merge with those of the libstdc++.so.6 that numpy,
# ml_dtypes or torch load: the first number formatted then crashes the process
# (SIGSEGV) or silently ends the text.
_CXX_RUNTIME_CODE = """
import importlib.util
import sys

def load_others():
    import numpy
    for name in ("ml_dtypes", "torch"):
        if importlib.util.find_spec(name) is not None:
            __import__(name)

if sys.argv[1] == "others-first":
    load_others()
import moelink
if sys.argv[1] == "moelink-first":
    load_others()
c = moelink.Config(max_num_tokens=8, num_experts=4, experts_per_token=2, hidden_dim=16)
want = ("Config(max_num_tokens=8, num_experts=4, experts_per_token=2, hidden_dim=16, "
        "hidden_dim_scale=0, in_dtype=bfloat16, out_dtype=bfloat16, rank=0, world_size=1, "
        "dp_size=1)")
assert repr(c) == want, repr(c)
try:
    moelink.Config(max_num_tokens=0).validate()
    raise AssertionError("validate() passed")
except ValueError as e:
    assert str(e).endswith("max_num_tokens = 0: must be in [1, 1048576]"), str(e)
print("ok")
"""


def _subprocess_env():
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(moelink.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.mark.parametrize("order", ["others-first", "moelink-first"])
def test_cxx_runtime_coexists_with_numpy_and_torch(order):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _CXX_RUNTIME_CODE, order], capture_output=True,
                       text=True, env=_subprocess_env(), timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, (
        f"exit code {r.returncode}: moelink._C formats numbers wrongly or crashes beside numpy / "
        "torch (-11 is SIGSEGV). Is libstdc++ linked statically into it and exported? See "
        f"test_module_does_not_export_libstdcxx.\n{r.stderr[-3000:]}")


def _elf_dynamic_symbols(path):
    """Names of the symbols an ELF64 little-endian shared object defines in
    its dynamic symbol table (what it exports), or None if it is no such file."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names = set()
    for _name, sh_type, _fl, _addr, off, size, link, _info, _al, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        str_off = sections[link][4]
        for pos in range(off, off + size, entsize or 24):
            st_name, _st_info, _st_other, st_shndx = struct.unpack_from("<IBBH", data, pos)
            if st_shndx == 0:  # undefined: imported, not exported
                continue
            end = data.index(b"\0", str_off + st_name)
            names.add(data[str_off + st_name:end].decode("ascii", "replace"))
    return names


def test_module_does_not_export_libstdcxx():
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("checks an ELF shared object")
    names = _elf_dynamic_symbols(moelink._C.__file__)
    if names is None:
        pytest.skip("not an ELF64 little-endian module")
    # libstdc++'s own runtime, never a template instantiation of the module.
    runtime = sorted(n for n in names
                     if n.startswith(("_ZNSt6locale", "_ZNSt8ios_base", "__cxa_", "__gxx_")))
    assert not runtime, (
        f"moelink._C exports {len(runtime)} libstdc++ runtime symbols ({runtime[:4]} ...): "
        "the toolchain linked libstdc++ statically and the module re-exports it, which "
        "crashes beside numpy / torch; link with -Wl,--exclude-libs,libstdc++.a")


@pytest.mark.parametrize("kw,field", [
    (dict(num_experts=7, world_size=2), "num_experts"),
    (dict(hidden_dim=20), "hidden_dim"),
    (dict(experts_per_token=17), "experts_per_token"),
    (dict(in_dtype="fp8", hidden_dim_scale=0), "hidden_dim_scale"),
    (dict(out_dtype="float32"), "out_dtype"),
    (dict(dp_size=3, world_size=2), "dp_size"),
    (dict(max_num_tokens=0), "max_num_tokens"),
])
def test_bad_config_value_error(kw, field):
    cfg = dict(SMALL, **kw)
    with pytest.raises(ValueError, match=field):
        moelink.Config(**cfg).validate()
    # AllToAll validates before any rendezvous: no peer is needed to fail.
    with pytest.raises(ValueError, match=field):
        moelink.AllToAll(backend="cpu", bootstrap=_NoBootstrap(),
                         **dict(cfg, world_size=cfg.get("world_size", 1)))


class _NoBootstrap(moelink.Bootstrap):
    """A Bootstrap that fails if it is used at all."""

    def __init__(self):
        super().__init__()

    def rank(self):
        raise AssertionError("bootstrap used before config validation")

    def world_size(self):
        raise AssertionError("bootstrap used before config validation")

    def all_gather(self, data):
        raise AssertionError("bootstrap used before config validation")


def test_bad_dtype_name():
    with pytest.raises(ValueError, match="in_dtype"):
        moelink.Config(**dict(SMALL, in_dtype="float99"))
    with pytest.raises(ValueError, match="out_dtype"):
        moelink.Config(**dict(SMALL, out_dtype=None))


def test_config_disagrees_with_bootstrap():
    bs = moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 10.0)
    with pytest.raises(ValueError, match="disagree"):
        moelink.AllToAll(moelink.Config(**dict(SMALL, world_size=2, rank=0, num_experts=4)),
                         backend="cpu", bootstrap=bs)


def test_python_bootstrap_subclass():
    class Solo(moelink.Bootstrap):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def rank(self):
            return 0

        def world_size(self):
            return 1

        def all_gather(self, data):
            self.calls += 1
            return bytes(data)

    bs = Solo()
    a2a = moelink.AllToAll(backend="cpu", bootstrap=bs, **SMALL)
    assert bs.calls > 0 and a2a.config.rank == 0 and a2a.config.world_size == 1
    bs.barrier()
    b = buffers(a2a)
    a2a.dispatch(**b)
    a2a.combine(**combine_args(a2a, b))
    a2a.check()


def test_python_bootstrap_bad_reply():
    class Wrong(moelink.Bootstrap):
        def __init__(self):
            super().__init__()

        def rank(self):
            return 0

        def world_size(self):
            return 1

        def all_gather(self, data):
            return bytes(data) + b"x"

    with pytest.raises(ValueError, match="all_gather"):
        moelink.AllToAll(backend="cpu", bootstrap=Wrong(), **SMALL)


def test_single_rank_roundtrip_values():
    a2a = single()
    c = a2a.config
    b = buffers(a2a)
    a2a.dispatch(**b)
    a2a.check()
    # one rank holds every expert: every route arrives
    counts = np.bincount(b["indices"].ravel(), minlength=c.num_experts)
    assert (b["out_expert_num_tokens"] == counts).all()
    ca = combine_args(a2a, b)
    ca["expert_y"][...] = b["out_expert_x"]  # identity experts
    a2a.combine(**ca)
    a2a.check()
    want = b["dp_x"].astype(np.float32) * (b["weights"].sum(1, keepdims=True))
    np.testing.assert_allclose(ca["out_tokens"].astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_bad_argument_dtype_and_shape():
    a2a = single()
    b = buffers(a2a)
    with pytest.raises(ValueError, match="out_expert_x"):
        a2a.dispatch(**dict(b, out_expert_x=b["out_expert_x"].astype(np.float32)))
    with pytest.raises(ValueError, match="dp_x"):
        a2a.dispatch(**dict(b, dp_x=b["dp_x"][:, :8]))
    with pytest.raises(ValueError, match="indices"):
        a2a.dispatch(**dict(b, indices=b["indices"].astype(np.float32)))
    with pytest.raises(ValueError, match="weights"):
        a2a.dispatch(**dict(b, weights=b["weights"].astype(np.float64)))
    with pytest.raises(ValueError, match="bound_m"):
        a2a.dispatch(**dict(b, bound_m=np.array([1, 2], np.int32)))
    with pytest.raises(ValueError, match="indices"):  # unsupported DLPack dtype
        a2a.dispatch(**dict(b, indices=b["indices"].astype(np.int16)))
    with pytest.raises(ValueError, match="dimensions"):
        a2a.dispatch(**dict(b, out_expert_x=np.zeros((1,) + b["out_expert_x"].shape,
                                                     np.float16)))
    with pytest.raises(TypeError, match="weights"):
        a2a.dispatch(**dict(b, weights=[[0.5, 0.5]] * 8))
    ro = b["out_expert_x"].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out_expert_x"):
        a2a.dispatch(**dict(b, out_expert_x=ro))
    # none of the failures advanced the call order
    a2a.dispatch(**b)
    a2a.combine(**combine_args(a2a, b))


def test_missing_scales_fp8():
    a2a = single(in_dtype="fp8", hidden_dim_scale=2)
    b = buffers(a2a, x_dtype=np.uint8)
    with pytest.raises(ValueError, match="dp_x_scale"):
        a2a.dispatch(**dict(b, dp_x_scale=None))
    a2a.dispatch(**b)
    a2a.check()
    assert b["out_expert_num_tokens"].sum() == b["indices"].size


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_ml_dtypes_arrays():
    a2a = single(in_dtype="fp8", hidden_dim_scale=1, out_dtype="bfloat16")
    b = buffers(a2a, x_dtype=np.uint8)
    b["dp_x"] = b["dp_x"].view(ml_dtypes.float8_e4m3fn)
    b["out_expert_x"] = b["out_expert_x"].view(ml_dtypes.float8_e4m3fn)
    a2a.dispatch(**b)
    a2a.check()
    n = b["out_expert_num_tokens"]
    rows = sorted(b["out_expert_x"][j, r].tobytes() for j in range(4) for r in range(n[j]))
    want = sorted(b["dp_x"][t].tobytes() for t in range(8) for _ in range(2))
    assert rows == want
    c = a2a.config
    out = np.zeros((8, 16), ml_dtypes.bfloat16)
    y = np.ones((4, c.expert_capacity, 16), ml_dtypes.bfloat16)
    a2a.combine(out, b["indices"], b["weights"], y, b["bound_m"])
    a2a.check()
    np.testing.assert_allclose(out.astype(np.float32), 1.0)  # 2 routes x 0.5 x 1


def test_call_order():
    a2a = single()
    b = buffers(a2a)
    with pytest.raises(ValueError, match="call order"):
        a2a.combine(**combine_args(a2a, b))
    with pytest.raises(ValueError, match="call order"):
        a2a.dispatch(**b, do_send=False)
    a2a.dispatch(**b, do_recv=False)
    with pytest.raises(ValueError, match="call order"):
        a2a.dispatch(**b, do_recv=False)
    a2a.dispatch(**b, do_send=False)
    with pytest.raises(ValueError, match="call order"):
        a2a.dispatch(**b)
    with pytest.raises(ValueError, match="do_send and do_recv"):
        a2a.combine(**combine_args(a2a, b), do_send=False, do_recv=False)
    a2a.combine(**combine_args(a2a, b))
    a2a.check()


def test_bad_expert_id_input_error():
    a2a = single()
    idx = np.array([[0, 1]] * 8, np.int32)
    idx[5, 1] = 99
    b = buffers(a2a, idx=idx)
    a2a.dispatch(**b)
    with pytest.raises(moelink.InputError, match="99"):
        a2a.check()
    a2a.check()  # input errors are cleared once reported
    assert b["out_expert_num_tokens"].tolist() == [8, 7, 0, 0]  # the bad route was dropped
    a2a.combine(**combine_args(a2a, b))
    a2a.check()


def test_bound_m_too_large_input_error():
    a2a = single()
    b = buffers(a2a)
    b["bound_m"][0] = 100
    a2a.dispatch(**b)
    with pytest.raises(moelink.InputError, match="bound_m"):
        a2a.check()


def test_closed():
    a2a = single()
    with a2a:
        pass
    assert a2a.closed
    with pytest.raises(ValueError, match="closed"):
        a2a.check()


def test_tcp_bootstrap_timeout():
    t0 = time.monotonic()
    with pytest.raises(moelink.TimeoutError):
        moelink.TcpBootstrap(0, 2, "127.0.0.1", free_port(), 0.5)
    assert time.monotonic() - t0 < 10


def test_bootstrap_argument_checks():
    with pytest.raises(TypeError, match="bootstrap"):
        moelink.AllToAll(backend="cpu", bootstrap=object(), **SMALL)
    with pytest.raises(TypeError, match="group"):
        moelink.AllToAll(backend="cpu", group=object(), **SMALL)
    with pytest.raises(ValueError, match="backend"):
        moelink.AllToAll(backend="mpi", **SMALL)


def test_stream_handle():
    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        ptr = 99

    assert moelink.stream_handle(None) == 0
    assert moelink.stream_handle(7) == 7
    assert moelink.stream_handle(TorchLike()) == 1234
    assert moelink.stream_handle(CupyLike()) == 99
    with pytest.raises(TypeError):
        moelink.stream_handle("s")


# --------------------------------------------------------------------------
# GPU: torch.distributed group + nvlink backend


def _torch_gpu_ok():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False, "needs >= 2 CUDA GPUs"
    if not moelink.with_cuda:
        return False, "moelink was built without CUDA"
    return True, ""


def _torch_worker(rank, world_size, port, backend):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        # DeepSeek-like, scaled down: fp8 tokens with 1x128 block scales,
        # top-8 of 64 experts, bf16 outputs.
        cfg = dict(max_num_tokens=32, num_experts=64, experts_per_token=8, hidden_dim=1024,
                   hidden_dim_scale=8, in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16,
                   rank=rank, world_size=world_size, dp_size=1)
        a2a = moelink.AllToAll(backend="nvlink", group=group, **cfg)
        c = a2a.config
        T, H, k, S = c.max_num_tokens, c.hidden_dim, c.experts_per_token, c.hidden_dim_scale
        L, C = c.num_local_experts, c.expert_capacity
        ref_cfg = dict(max_num_tokens=T, hidden_dim=H, experts_per_token=k,
                       num_experts=c.num_experts, hidden_dim_scale=S, world_size=world_size,
                       out_dtype="bfloat16")
        dev = torch.device("cuda", rank)
        side = torch.cuda.Stream(dev)
        for rnd in range(3):
            groups = []
            for g in range(world_size):
                x, scale, idx, w = make_group_inputs(ref_cfg, 99 + rnd, g, T, "fp8")
                groups.append((x, scale, idx, w, group_m(ref_cfg, 99, g, rnd)))
            x, scale, idx, w, m = groups[rank]
            dp_x = torch.from_numpy(x).to(dev).view(torch.float8_e4m3fn)
            dp_s = torch.from_numpy(scale).to(dev)
            ind = torch.from_numpy(idx).to(dev)  # int64
            wt = torch.from_numpy(w).to(dev)
            bm = torch.tensor([m], dtype=torch.int32, device=dev)
            num = torch.zeros(L, dtype=torch.int32, device=dev)
            ox = torch.zeros((L, C, H), dtype=torch.float8_e4m3fn, device=dev)
            os_ = torch.zeros((L, S, C), dtype=torch.float32, device=dev).transpose(1, 2)
            torch.cuda.synchronize()
            with torch.cuda.stream(side):  # stream=None -> torch's current stream
                if rnd == 2:
                    a2a.dispatch(num, ox, os_, dp_x, dp_s, ind, wt, bm, do_recv=False)
                    a2a.dispatch(num, ox, os_, dp_x, dp_s, ind, wt, bm, do_send=False)
                else:
                    a2a.dispatch(num, ox, os_, dp_x, dp_s, ind, wt, bm)
                e_ids = (rank * L + torch.arange(L, device=dev)).float().view(L, 1, 1)
                y = (os_[:, :, :1] * (e_ids + 1)).expand(L, C, H).to(torch.bfloat16).contiguous()
                out = torch.full((T, H), 3.0, dtype=torch.bfloat16, device=dev)
                a2a.combine(out, ind, wt, y, bm, stream=torch.cuda.current_stream(dev))
            side.synchronize()
            a2a.check()
            exp = expected_dispatch(dict(ref_cfg, world_size=world_size), rank, groups)
            num_h = num.cpu().numpy()
            ox_h = ox.view(torch.uint8).cpu().numpy()
            os_h = os_.cpu().numpy()
            for j in range(L):
                assert num_h[j] == len(exp[j]), (rnd, j, num_h[j], len(exp[j]))
                got = sorted(ox_h[j, r].tobytes() + os_h[j, r].tobytes()
                             for r in range(num_h[j]))
                assert got == exp[j], f"round {rnd}: expert {j} rows differ"
            ref, mag = expected_combine(ref_cfg, x, scale, idx, w, m, "fp8", "bfloat16")
            got = out.float().cpu().numpy()
            tol = 3 * unit_roundoff("bfloat16") * mag + 1e-6
            assert (np.abs(got[:m] - ref) <= tol).all(), f"round {rnd}: combine differs"
            assert (got[m:] == 3.0).all()
        a2a.close()
    finally:
        dist.destroy_process_group()


def test_torch_nvlink_group():
    ok, why = _torch_gpu_ok()
    if not ok:
        pytest.skip(f"{why}: this test runs on the GPU machine (torch + >= 2 GPUs)")
    if ml_dtypes is None:
        pytest.skip("needs ml_dtypes for the bfloat16 reference")
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    backend = "nccl" if dist.is_nccl_available() else "gloo"
    tmp.spawn(_torch_worker, args=(2, free_port(), backend), nprocs=2, join=True)
