"""moelink.integrations.sglang: MoelinkDispatcher (SGLang's dispatcher
interface, low-latency format) on the cpu backend across 2 and 3 processes
joined by a gloo torch.distributed group, against a float64 reference of
dispatch -> experts -> combine; the call-order and size errors; and the
plugin hook that swaps it in for SGLang's pplx dispatcher. Skipped without
torch or SGLang (0.5.23; not in CI's environment, see docs/sglang_integration.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="needs torch (not installed)")
pytest.importorskip("sglang.srt.layers.moe.token_dispatcher.base",
                    reason="needs SGLang 0.5.23 (not installed)")

from ranks_testlib import free_port, run_ranks  # noqa: E402

MAX_TOKENS = 8


def _sglang_context(monkeypatch_target, world_size):
    """SGLang's server context (parallel layout, dispatch dtype) as a
    launched server would set it; the dispatcher reads nothing else."""
    from sglang.srt.layers.moe.utils import DispatcherOutputDtype

    monkeypatch_target.get_parallel = lambda: types.SimpleNamespace(
        attn_tp_size=1, attn_dp_size=world_size, nnodes=1)
    monkeypatch_target.get_deepep_output_dtype = lambda _self: DispatcherOutputDtype.BF16


def _make_dispatcher(world_size, E, k, H):
    os.environ["SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    from sglang.srt.layers.moe.utils import DeepEPMode

    import moelink.integrations.sglang as msg

    _sglang_context(msg, world_size)
    d = msg.MoelinkDispatcher(group=torch.distributed.group.WORLD, router_topk=k,
                              num_experts=E, num_local_experts=E // world_size, hidden_size=H,
                              params_dtype=torch.bfloat16, deepep_mode=DeepEPMode.LOW_LATENCY)
    d.set_quant_config({})
    return msg, d


def scenario_dispatcher_round_trip(rank, world_size, bs, port, seed):
    import torch.distributed as dist
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        E, k, H = 2 * world_size, 2, 32
        L = E // world_size
        msg, d = _make_dispatcher(world_size, E, k, H)
        gen = torch.Generator().manual_seed(seed * 100 + rank)
        for case in ("0", "1", "2", "odd", "full", "skew", "full"):
            m = {"0": 0, "1": 1, "2": 2, "odd": 3 + 2 * rank, "full": MAX_TOKENS,
                 "skew": MAX_TOKENS}[case]
            x = torch.randn((m, H), generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(m)]).int() \
                if m else torch.empty((0, k), dtype=torch.int32)
            if case == "skew":  # every token of every rank to expert 0, one route dropped
                ids[:, 0] = 0
                ids[:, 1] = -1
            w = torch.rand((m, k), generator=gen)
            out = d.dispatch(x, StandardTopKOutput(w, ids, torch.zeros((m, E))))
            assert out.format.name == "DEEPEP_LL"
            # Every rank's routes to my experts: masked_m and the row sums.
            all_ids = [torch.zeros((MAX_TOKENS, k), dtype=torch.int32) for _ in range(world_size)]
            all_x = [torch.zeros((MAX_TOKENS, H)) for _ in range(world_size)]
            all_m = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            pad_ids = torch.full((MAX_TOKENS, k), -1, dtype=torch.int32)
            pad_ids[:m] = ids
            pad_x = torch.zeros((MAX_TOKENS, H))
            pad_x[:m] = x.float()
            dist.all_gather(all_ids, pad_ids)
            dist.all_gather(all_x, pad_x)
            dist.all_gather(all_m, torch.tensor([m]))
            for l in range(L):
                e = rank * L + l
                rows = [all_x[r][t] for r in range(world_size) for t in range(int(all_m[r]))
                        if (all_ids[r][t] == e).any()]
                n = int(out.masked_m[l])
                assert n == len(rows), f"{case}: expert {e} got {n} rows, expected {len(rows)}"
                if n:
                    got = out.hidden_states[l, :n].double().sum(0)
                    want = torch.stack(rows).double().sum(0)
                    assert torch.allclose(got, want, atol=1e-6), f"{case}: expert {e} rows"
            # Expert e scales its rows by (e + 1); combine sends them home.
            scale = torch.arange(rank * L + 1, rank * L + L + 1, dtype=torch.float32)
            y = (out.hidden_states.float() * scale.view(L, 1, 1)).to(torch.bfloat16)
            combined = d.combine(msg.MoelinkCombineInput(y, out.topk_ids, out.topk_weights))
            assert combined.shape == (m, H) and combined.dtype == torch.bfloat16
            ref = torch.zeros((m, H), dtype=torch.float64)
            mag = torch.zeros_like(ref)
            for t in range(m):
                for i in range(k):
                    e = int(ids[t, i])
                    if e >= 0:
                        term = float(w[t, i]) * (x[t].float() * (e + 1)).to(torch.bfloat16).double()
                        ref[t] += term
                        mag[t] += term.abs()
            err = (combined.double() - ref).abs()
            assert bool((err <= 2 * 2.0**-8 * mag + 1e-6).all()), \
                f"{case}: rank {rank} max err {float(err.max()) if m else 0}"
        msg.close_all()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatcher_round_trip_matches_reference(world_size):
    run_ranks(world_size, scenario_dispatcher_round_trip, timeout=240.0, port=free_port(),
              seed=torch.seed() % 10_000)


def scenario_errors_keep_dispatcher_usable(rank, world_size, bs, port):
    import torch.distributed as dist
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        msg, d = _make_dispatcher(world_size, 2, 1, 16)
        with pytest.raises(RuntimeError, match="combine_a called after IDLE"):
            d.combine_a(msg.MoelinkCombineInput(torch.zeros((1, 4, 16)), torch.zeros((1, 1)),
                                                torch.zeros((1, 1))))
        big = MAX_TOKENS + 1
        with pytest.raises(ValueError, match=f"{big} tokens exceed the per-rank limit {MAX_TOKENS}"):
            d.dispatch_a(torch.zeros((big, 16), dtype=torch.bfloat16),
                         StandardTopKOutput(torch.ones((big, 1)), torch.zeros((big, 1)).int(), None))
        x = torch.ones((2, 16), dtype=torch.bfloat16)
        out = d.dispatch(x, StandardTopKOutput(torch.ones((2, 1)), torch.zeros((2, 1)).int(), None))
        y = out.hidden_states.clone()
        back = d.combine(msg.MoelinkCombineInput(y, out.topk_ids, out.topk_weights))
        assert torch.equal(back, x)
        msg.close_all()
    finally:
        dist.destroy_process_group()


def test_rejected_calls_leave_the_dispatcher_usable():
    run_ranks(2, scenario_errors_keep_dispatcher_usable, timeout=120.0, port=free_port())


def test_deepep_mode_other_than_low_latency_is_refused():
    from sglang.srt.layers.moe.utils import DeepEPMode

    import moelink.integrations.sglang as msg

    with pytest.raises(NotImplementedError, match="--deepep-mode low_latency"):
        msg.MoelinkDispatcher(group=None, router_topk=2, num_experts=4, num_local_experts=4,
                              hidden_size=16, params_dtype=torch.bfloat16,
                              deepep_mode=DeepEPMode.AUTO)


_PLUGIN_PROBE = """
import moelink.integrations.sglang as msg
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang.srt.layers.moe.token_dispatcher as td
import sglang.srt.batch_overlap.two_batch_overlap as tbo
# In a list: the hook registry rebinds every module global that holds the original.
tbo_init = [tbo.MaybeTboDeepEPDispatcher.__init__]
msg.register()
HookRegistry.apply_hooks()
print(td.PplxDispatcher is msg.MoelinkDispatcher, tbo.PplxDispatcher is msg.MoelinkDispatcher,
      tbo.MaybeTboDeepEPDispatcher.__init__ is not tbo_init[0])
if td.PplxDispatcher is msg.MoelinkDispatcher:
    # Two-batch overlap on, --moe-a2a-backend pplx: two inners, numbered.
    import types, torch
    from sglang.srt.layers.moe.utils import DeepEPMode, DispatcherOutputDtype
    no = lambda: False
    tbo.is_tbo_enabled = lambda: True
    tbo.get_moe_a2a_backend = lambda: types.SimpleNamespace(
        is_deepep=no, is_mooncake=no, is_mori=no, is_nixl=no, is_pplx=lambda: True)
    msg.get_deepep_output_dtype = lambda _self: DispatcherOutputDtype.BF16
    d = tbo.MaybeTboDeepEPDispatcher(group=None, router_topk=2, permute_fusion=True,
                                     num_experts=4, num_local_experts=2, hidden_size=16,
                                     params_dtype=torch.bfloat16,
                                     deepep_mode=DeepEPMode.LOW_LATENCY, async_finish=True,
                                     return_recv_hook=True)
    print([type(i).__name__ for i in d._inners], [i.subbatch_index for i in d._inners])
"""


@pytest.mark.parametrize("switch", ["1", "0"])
def test_plugin_replaces_pplx_dispatcher_only_when_switched_on(switch):
    env = dict(os.environ, MOELINK_SGLANG=switch, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    if switch == "1":
        assert lines[-2:] == ["True True True",
                              "['MoelinkDispatcher', 'MoelinkDispatcher'] [0, 1]"], r.stdout
    else:
        assert lines[-1] == "False False False", r.stdout
