"""moelink.integrations.vllm: MoelinkPrepareAndFinalize inside vLLM's own
FusedMoEKernel with vLLM's reference experts (NaiveBatchedExperts) on the
cpu backend, across 1, 2 and 4 processes joined by a gloo torch.distributed
group, against a float64 reference of the whole MoE and (one rank) against
vLLM's own BatchedPrepareAndFinalize; empty, one-token, odd and full
batches, a dropped route; the per-rank limit; and the plugin hook. The
same on the nvlink backend with the ranks sharing GPU 0 where there is one
(the device machine, with vLLM's Python files carried there). Skipped
without torch or vLLM (0.33; not in CI's environment, see
docs/vllm_integration.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (not installed)")
pytest.importorskip("vllm.model_executor.layers.fused_moe.modular_kernel",
                    reason="needs vLLM 0.33 (not installed)")

from ranks_testlib import free_port, run_ranks  # noqa: E402

MAX_TOKENS = 8


def _vllm_worker_setup(device):
    """What a vLLM worker sets up before its MoE layers run: the workspace
    manager on `device`, its silu_and_mul (compiled code in vLLM's wheel,
    here torch's), and its capture check (which asks the CUDA stream: never
    capturing on the CPU; on a torch older than vLLM's, the same question
    through that torch's API)."""
    import vllm.model_executor.layers.fused_moe.experts.fused_batched_moe as fbm
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device(device))
    if device == "cpu":
        fbm._is_capturing_or_compiling = lambda: False
    elif not hasattr(torch.accelerator.current_stream(), "is_capturing"):
        # vLLM 0.33 asks torch 2.14's Stream.is_capturing; the same question
        # in the torch of the device machine (2.11).
        fbm._is_capturing_or_compiling = lambda: (torch.cuda.is_current_stream_capturing()
                                                  or torch.compiler.is_compiling())
    if not hasattr(torch.ops._C, "silu_and_mul"):
        lib = torch.library.Library("_C", "DEF")
        lib.define("silu_and_mul(Tensor(a!) out, Tensor input) -> ()")

        def silu_and_mul(out, x):
            d = x.shape[-1] // 2
            out.copy_(torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float())

        for key in ("CPU", "CUDA"):
            lib.impl("silu_and_mul", silu_and_mul, key)
        _vllm_worker_setup.lib = lib  # kept alive


def _kernel(prepare_finalize, E, k, H, N, L, world_size, device="cpu"):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             FusedMoEQuantConfig, RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts

    cfg = FusedMoEConfig(num_experts=E, experts_per_token=k, hidden_dim=H, intermediate_size=N,
                         num_local_experts=L, num_logical_experts=E, activation=MoEActivation.SILU,
                         device=device, routing_method=RoutingMethodType.TopK,
                         moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
                         in_dtype=torch.bfloat16, max_num_tokens=MAX_TOKENS)
    experts = NaiveBatchedExperts(cfg, FusedMoEQuantConfig.make(), max_num_tokens=MAX_TOKENS,
                                  num_dispatchers=world_size)
    return mk.FusedMoEKernel(prepare_finalize, experts)


def _reference(x, ids, w, w1, w2, N):
    """float64: sum_i w[t, i] * W2_e (silu(gate) * up) of W1_e x[t]."""
    ref = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float64)
    for t in range(x.shape[0]):
        for i in range(ids.shape[1]):
            e = int(ids[t, i])
            if e < 0:
                continue
            h = w1[e].double() @ x[t].double()
            ref[t] += float(w[t, i]) * (w2[e].double() @ (torch.nn.functional.silu(h[:N]) * h[N:]))
    return ref


def scenario_moe_matches_reference(rank, world_size, bs, port, seed, backend="cpu"):
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    import moelink.integrations.vllm as mv

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    dev = "cuda:0" if backend == "nvlink" else "cpu"  # nvlink: the ranks share GPU 0
    try:
        _vllm_worker_setup(dev)
        E, k, H, N = 2 * world_size, 2, 128, 64
        L = E // world_size
        shared = torch.Generator().manual_seed(seed)  # every rank's copy of all weights
        w1 = (torch.randn((E, 2 * N, H), generator=shared) / H ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn((E, H, N), generator=shared) / N ** 0.5).to(torch.bfloat16)
        pf = mv.MoelinkPrepareAndFinalize(
            dist.group.WORLD, max_tokens_per_rank=MAX_TOKENS, num_experts=E, experts_per_token=k,
            hidden_size=H, params_dtype=torch.bfloat16, num_dispatchers=world_size, backend=backend)
        kern = _kernel(pf, E, k, H, N, L, world_size, dev)
        # The inputs are made on the CPU (the same values on either backend)
        # and moved; outputs come back for the float64 reference.
        on = (lambda t: t.to(dev))
        mine = slice(rank * L, rank * L + L)
        w1_mine, w2_mine = on(w1[mine]), on(w2[mine])
        gen = torch.Generator().manual_seed(seed * 100 + rank)
        for case in ("0", "1", "2", "odd", "full", "dropped"):
            m = {"0": 0, "1": 1, "2": 2, "odd": 3 + 2 * (rank % 3), "full": MAX_TOKENS,
                 "dropped": MAX_TOKENS}[case]
            x = torch.randn((m, H), generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(m)]).int() \
                if m else torch.empty((0, k), dtype=torch.int32)
            if case == "dropped":
                ids[:, 1] = -1
            w = torch.rand((m, k), generator=gen)
            out = kern.apply(on(x), w1_mine, w2_mine, on(w), on(ids), MoEActivation.SILU, E, None, False).cpu()
            assert out.shape == (m, H) and out.dtype == torch.bfloat16, (case, out.shape, out.dtype)
            if m == 0:
                continue
            ref = _reference(x, ids, w, w1, w2, N)
            rel = float((out.double() - ref).norm() / ref.norm())
            # bf16 inputs, vLLM's bf16 intermediate and expert output, the
            # combine's bf16 sum: about 0.4 % (measured), bound 2 %.
            assert rel < 2e-2, f"{case}: rank {rank} relative L2 {rel:.2e}"
        # Top-1 with the router weight applied to the input (before the experts).
        top1 = _kernel(mv.MoelinkPrepareAndFinalize(
            dist.group.WORLD, max_tokens_per_rank=MAX_TOKENS, num_experts=E, experts_per_token=1,
            hidden_size=H, params_dtype=torch.bfloat16, num_dispatchers=world_size, backend=backend),
            E, 1, H, N, L, world_size, dev)
        x = torch.randn((4, H), generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, E, (4, 1), generator=gen, dtype=torch.int32)
        w = torch.rand((4, 1), generator=gen) + 0.5
        out = top1.apply(on(x), w1_mine, w2_mine, on(w), on(ids), MoEActivation.SILU, E, None, True).cpu()
        ref = _reference((x.float() * w).to(torch.bfloat16), ids, torch.ones_like(w), w1, w2, N)
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < 2e-2, f"apply_router_weight_on_input: rank {rank} relative L2 {rel:.2e}"
        if world_size == 1:  # the same MoE through vLLM's own single-rank prepare/finalize
            from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import \
                BatchedPrepareAndFinalize

            theirs = _kernel(BatchedPrepareAndFinalize(max_num_tokens=MAX_TOKENS, num_local_experts=E,
                                                       num_dispatchers=1, rank=0), E, k, H, N, E, 1, dev)
            x = torch.randn((5, H), generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(5)]).int()
            w = torch.rand((5, k), generator=gen)
            a = kern.apply(on(x), on(w1), on(w2), on(w), on(ids), MoEActivation.SILU, E, None, False).cpu()
            b = theirs.apply(on(x), on(w1), on(w2), on(w), on(ids), MoEActivation.SILU, E, None, False).cpu()
            rel = float((a.double() - b.double()).norm() / b.double().norm())
            assert rel < 1e-2, f"against vLLM's BatchedPrepareAndFinalize: {rel:.2e}"
        # More tokens than the per-rank limit: refused, and the object stays usable.
        big = MAX_TOKENS + 1
        with pytest.raises(ValueError, match=f"{big} tokens exceed the per-rank limit"):
            kern.apply(on(torch.zeros((big, H), dtype=torch.bfloat16)), w1_mine, w2_mine,
                       on(torch.ones((big, k))), on(torch.zeros((big, k), dtype=torch.int32)),
                       MoEActivation.SILU, E, None, False)
        x = torch.randn((3, H), generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(3)]).int()
        w = torch.rand((3, k), generator=gen)
        out = kern.apply(on(x), w1_mine, w2_mine, on(w), on(ids), MoEActivation.SILU, E, None, False).cpu()
        ref = _reference(x, ids, w, w1, w2, N)
        assert float((out.double() - ref).norm() / ref.norm()) < 2e-2, "after the refused call"
    finally:
        from moelink.integrations._shared import close_all

        close_all()
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["cpu", "nvlink"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_moe_through_vllm_matches_reference(world_size, backend):
    if backend == "nvlink":
        import moelink

        if not (moelink.with_cuda and torch.cuda.is_available()):
            pytest.skip("needs a Hopper GPU (runs on the H200 device machine)")
    run_ranks(world_size, scenario_moe_matches_reference, timeout=300.0, port=free_port(),
              seed=torch.seed() % 10_000, backend=backend)


def test_plugin_swaps_in_for_deepep_low_latency():
    """register() wraps maybe_make_prepare_finalize where vLLM holds it; a
    config that asks for DeepEP's low-latency kernels gets moelink's (make_for
    stubbed: it needs vLLM's distributed state), any other vLLM's own."""
    import types

    import moelink.integrations.vllm as mv
    from vllm.model_executor.layers.fused_moe import all2all_utils

    original = all2all_utils.maybe_make_prepare_finalize
    made = []
    saved = mv.make_for
    mv.make_for = lambda moe, qc, mgr=None: made.append(moe) or "moelink"
    try:
        mv.register()
        wrapped = all2all_utils.maybe_make_prepare_finalize
        assert wrapped is not original and wrapped._moelink
        mv.register()  # a second call changes nothing
        assert all2all_utils.maybe_make_prepare_finalize is wrapped
        ll = types.SimpleNamespace(
            moe_parallel_config=types.SimpleNamespace(use_all2all_kernels=True),
            use_deepep_ll_kernels=True)
        assert wrapped(ll, None) == "moelink" and made == [ll]
        other = types.SimpleNamespace(
            moe_parallel_config=types.SimpleNamespace(use_all2all_kernels=False,
                                                      use_passthrough_all2all=True),
            use_deepep_ll_kernels=False)
        assert wrapped(other, None) is not None and made == [ll]  # vLLM's own pass-through
    finally:
        mv.make_for = saved
        all2all_utils.maybe_make_prepare_finalize = original
