"""moelink.torch_ops: dispatch, combine and the expert MLP as torch.library
custom ops, eager and under torch.compile (fullgraph, inductor), on the cpu
backends across 1, 2 and 3 processes, against a float64 reference of the
round trip. Skipped without torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="moelink.torch_ops needs torch (not installed)")

import moelink  # noqa: E402
import moelink.torch_ops as ops  # noqa: E402
from fp8_testlib import block_quant  # noqa: E402
from ranks_testlib import free_port, run_ranks  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _config(world_size, dtype):
    return dict(max_num_tokens=8, num_experts=3 * world_size, experts_per_token=3, hidden_dim=32,
                in_dtype=dtype, out_dtype=dtype)


class MoERoundTrip(torch.nn.Module):
    """dispatch -> expert e scales its rows by (e + 1) -> combine, all inside
    forward (the buffers are intermediates the compiler allocates)."""

    def __init__(self, a2a):
        super().__init__()
        c = a2a.config
        self.handle = ops.handle(a2a)
        self.L, self.C, self.H = c.num_local_experts, c.expert_capacity, c.hidden_dim
        self.first_expert = c.rank * c.num_local_experts
        self.dtype = DTYPES[str(c.out_dtype)]

    def forward(self, x, indices, weights, bound_m):
        num = torch.full((self.L,), -1, dtype=torch.int32)
        ex = torch.full((self.L, self.C, self.H), float("nan"), dtype=x.dtype)  # poisoned
        torch.ops.moelink.dispatch(self.handle, num, ex, None, x, None, indices, weights, bound_m)
        scale = torch.arange(self.first_expert + 1, self.first_expert + self.L + 1,
                             dtype=torch.float32).view(self.L, 1, 1)
        ey = (ex.float() * scale).to(self.dtype)
        out = torch.full((x.shape[0], self.H), float("nan"), dtype=self.dtype)
        torch.ops.moelink.combine(self.handle, out, indices, weights, ey, bound_m)
        return out, num


def _routes(gen, T, E, k, skew):
    if skew:  # every token to expert 0 (one rank's one expert takes everything)
        idx = torch.full((T, k), -1, dtype=torch.int64)
        idx[:, 0] = 0
        return idx
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.empty((0, k), dtype=torch.int64)
    drop = torch.rand((T, k), generator=gen) < 0.2  # -1: no route
    return torch.where(drop, torch.full_like(idx, -1), idx)


def _reference(x, idx, w, m, E, dtype):
    """out[t] for t < m in float64 with the expert outputs rounded to dtype
    as the experts write them; and sum |terms| for the error bound."""
    ref = torch.zeros((m, x.shape[1]), dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for t in range(m):
        for i in range(idx.shape[1]):
            e = int(idx[t, i])
            if 0 <= e < E:
                y = (x[t].float() * (e + 1)).to(dtype).double()
                ref[t] += float(w[t, i]) * y
                mag[t] += abs(float(w[t, i])) * y.abs()
    return ref, mag


def scenario_compiled_round_trip(rank, world_size, bs, dtype, seed):
    torch.manual_seed(0)
    cfg = _config(world_size, dtype)
    E, k, T = cfg["num_experts"], cfg["experts_per_token"], cfg["max_num_tokens"]
    tdt = DTYPES[dtype]
    with moelink.AllToAll(backend="cpu", bootstrap=bs, timeout_s=20.0, **cfg) as a2a:
        module = MoERoundTrip(a2a)
        compiled = torch.compile(module, fullgraph=True, dynamic=False)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        # Every rank runs the same sequence of calls (collective), each with
        # its own token count: 0, 1, 2, odd, full, and a skewed routing.
        for m, skew in ((0, False), (1, False), (2, False), (5, False), (T, False), (T, True),
                        (3 - rank % 3, False)):
            x = (torch.randn((T, cfg["hidden_dim"]), generator=gen)).to(tdt)
            idx = _routes(gen, T, E, k, skew)
            w = torch.rand((T, k), generator=gen, dtype=torch.float32)
            bound = torch.tensor([m], dtype=torch.int32)
            out_c, num_c = compiled(x, idx, w, bound)
            out_e, num_e = module(x, idx, w, bound)
            assert torch.equal(num_c, num_e), (num_c, num_e)
            assert torch.equal(out_c[:m], out_e[:m]), "compiled and eager round trips differ"
            assert not out_c[:m].isnan().any(), "a row below m was not written"
            ref, mag = _reference(x, idx, w, m, E, tdt)
            err = (out_c[:m].double() - ref).abs()
            bound_err = 2 * UNIT_ROUNDOFF[dtype] * mag + 1e-6
            assert bool((err <= bound_err).all()), \
                f"rank {rank} m={m} skew={skew}: max err {float(err.max())}"
        a2a.check()


@pytest.mark.parametrize("world_size,dtype", [(1, "bfloat16"), (2, "float16"), (3, "bfloat16")])
def test_compiled_round_trip_matches_reference(world_size, dtype):
    run_ranks(world_size, scenario_compiled_round_trip, timeout=300.0, dtype=dtype,
              seed=torch.seed() % 10_000)


# ---------------------------------------------------------------- one process

def _one_rank(**kw):
    bs = moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 10.0)
    return moelink.AllToAll(backend="cpu", bootstrap=bs, timeout_s=5.0,
                            **dict(_config(1, "bfloat16"), **kw))


def test_handle_is_stable_weak_and_checked():
    a2a = _one_rank()
    h = ops.handle(a2a)
    assert h == ops.handle(a2a) and h > 0
    assert ops.lookup(h) is a2a
    other = _one_rank()
    assert ops.handle(other) != h
    with pytest.raises(TypeError, match="needs a Experts"):
        ops.lookup(h, moelink.Experts)
    with pytest.raises(TypeError, match="moelink.AllToAll or moelink.Experts"):
        ops.handle(object())
    a2a.close()
    del a2a
    with pytest.raises(ValueError, match=f"handle = {h} names no live moelink object"):
        ops.lookup(h)
    x = torch.zeros((8, 32), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="names no live"):
        torch.ops.moelink.combine(h, x, torch.zeros((8, 3), dtype=torch.int32),
                                  torch.zeros((8, 3)), torch.zeros((3, 8, 32), dtype=torch.bfloat16),
                                  torch.zeros(1, dtype=torch.int32))
    other.close()


def test_schemas_name_the_tensors_they_write():
    written = {
        "dispatch": {"out_expert_num_tokens", "out_expert_x", "out_expert_x_scale"},
        "combine": {"out_tokens"},
        "experts_forward": {"expert_y"},
    }
    for name, outs in written.items():
        schema = getattr(torch.ops.moelink, name).default._schema
        got = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert got == outs, (name, got)
        assert len(schema.returns) == 0


def test_fake_tensor_mode_traces_without_calling_moelink():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty((8, 32), dtype=torch.bfloat16)
        idx = torch.empty((8, 3), dtype=torch.int64)
        w = torch.empty((8, 3))
        m = torch.empty(1, dtype=torch.int32)
        # Handle 0 names nothing: only the fake implementation may run.
        torch.ops.moelink.dispatch(0, torch.empty(3, dtype=torch.int32),
                                   torch.empty((3, 8, 32), dtype=torch.bfloat16), None, x, None,
                                   idx, w, m)
        torch.ops.moelink.combine(0, x, idx, w, torch.empty((3, 8, 32), dtype=torch.bfloat16), m)
        with pytest.raises(ValueError, match="expert_y must have 3 dimensions"):
            torch.ops.moelink.combine(0, x, idx, w, torch.empty((8, 32), dtype=torch.bfloat16), m)


def test_rejected_call_then_good_calls():
    a2a = _one_rank()
    module = MoERoundTrip(a2a)
    T, H = 8, 32
    idx = torch.tensor([[0, 1, 2]] * T)
    w = torch.full((T, 3), 0.5)
    bound = torch.tensor([T], dtype=torch.int32)
    with pytest.raises(moelink.Error, match="dp_x"):  # fp32 tokens for a bf16 config
        module(torch.ones((T, H)), idx, w, bound)
    a2a.reset_call_order()
    for _ in range(2):  # the object stays usable and the error does not come back
        out, num = module(torch.ones((T, H), dtype=torch.bfloat16), idx, w, bound)
        assert num.tolist() == [T, T, T]
        assert torch.equal(out, torch.full((T, H), 0.5 * (1 + 2 + 3), dtype=torch.bfloat16))
    a2a.check()
    a2a.close()


def test_experts_op_matches_the_method_and_passes_opcheck():
    L, C, H, I = 2, 4, 128, 128
    gen = torch.Generator().manual_seed(torch.seed() % 10_000)
    ex = moelink.Experts(L, C, H, I, device="cpu")
    w13, w13s = block_quant(torch, torch.randn((L, 2 * I, H), generator=gen) * 0.05)
    w2, w2s = block_quant(torch, torch.randn((L, H, I), generator=gen) * 0.05)
    x = (torch.randn((L, C, H), generator=gen) * 4).to(torch.float8_e4m3fn)
    xs = torch.rand((L, C, H // 128), generator=gen) + 0.5
    for counts in ([0, 0], [1, 0], [3, 4]):
        n = torch.tensor(counts, dtype=torch.int32)
        y_op = torch.full((L, C, H), 7.0, dtype=torch.bfloat16)
        y_method = y_op.clone()
        torch.ops.moelink.experts_forward(ops.handle(ex), y_op, n, x, xs, w13, w13s, w2, w2s)
        ex.forward(y_method, n, x, xs, w13, w13s, w2, w2s)
        assert torch.equal(y_op, y_method)
        for l in range(L):
            assert bool((y_op[l, counts[l]:] == 7.0).all()), "rows past the count were written"
            if counts[l]:
                assert y_op[l, :counts[l]].float().abs().sum() > 0
    # opcheck's schema test does arithmetic that CPU torch lacks for fp8:
    # hand it the fp8 tensors as uint8 (which moelink also takes).
    u8 = torch.uint8
    torch.library.opcheck(torch.ops.moelink.experts_forward.default,
                          (ops.handle(ex), torch.zeros((L, C, H), dtype=torch.bfloat16),
                           torch.tensor([2, 3], dtype=torch.int32), x.view(u8), xs, w13.view(u8),
                           w13s, w2.view(u8), w2s))
    ex.check()
