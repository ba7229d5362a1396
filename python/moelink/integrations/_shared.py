"""What the engine integrations share: one moelink.AllToAll per
configuration (every MoE layer of a sub-batch uses it; its buffers are the
biggest allocation moelink makes), the per-rank token limit, the dispatch
into and the combine out of the batched-experts layout, and the 1x128 fp8
quantization of tokens before dispatch."""

from __future__ import annotations

import threading

import torch

from .. import torch_ops
from .._all_to_all import AllToAll

FP8_GROUP = 128  # DeepSeek-V3's 1x128 activation groups
FP8_MAX = 448.0  # e4m3's largest finite value

_lock = threading.Lock()
_all_to_alls: dict = {}  # key -> moelink.AllToAll


def shared_all_to_all(key: tuple, make) -> AllToAll:
    """The AllToAll for `key`, made by make() the first time (collective:
    every rank must reach this in the same order)."""
    with _lock:
        a2a = _all_to_alls.get(key)
        if a2a is None or a2a.closed:
            a2a = make()
            _all_to_alls[key] = a2a
        return a2a


def close_all() -> None:
    """Frees every shared AllToAll (tests; a server exits instead)."""
    with _lock:
        for a2a in _all_to_alls.values():
            a2a.close()
        _all_to_alls.clear()


def one_row_if_empty(t: torch.Tensor, fill) -> torch.Tensor:
    """moelink's inputs have 1..max_num_tokens rows (bound_m says how many
    are valid): an empty batch sends one row that bound_m = 0 hides."""
    return t if t.shape[0] else torch.full((1, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)


def quantize_fp8_groups(x: torch.Tensor):
    """x [m, H] -> (fp8 e4m3 [m, H], fp32 scales [m, H / 128]): each 1x128
    group scaled so that its largest magnitude is e4m3's largest value."""
    g = x.float().unflatten(-1, (-1, FP8_GROUP))
    scale = g.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return q, scale.contiguous()


def check_token_limit(m: int, limit: int, where: str, hint: str) -> None:
    """A ValueError naming the call, the count and the limit when m > limit."""
    if m > limit:
        raise ValueError(f"moelink {where}: {m} tokens exceed the per-rank limit {limit}; {hint}")


def dispatch_batched(a2a: AllToAll, num_local_experts: int, x: torch.Tensor,
                     x_scale, topk_ids: torch.Tensor, weights: torch.Tensor, m: int):
    """torch.ops.moelink.dispatch of m tokens (x [>= 1, H] as it is sent:
    fp8 with x_scale [.., H/128], or the model dtype and None; topk_ids and
    fp32 weights [m, k]) into the batched-experts layout. Returns (rows [L]
    int32 valid rows per local expert, tokens [L, C, H], scales [L, C, H/128]
    or None)."""
    L, C, H = num_local_experts, a2a.config.expert_capacity, x.shape[1]
    dev = x.device
    rows = torch.empty(L, dtype=torch.int32, device=dev)
    expert_x = torch.empty((L, C, H), dtype=x.dtype, device=dev)
    # Zeros, not garbage, behind the valid rows: a GEMM that reads a whole
    # tile must not meet NaN scales.
    expert_scale = torch.zeros((L, C, H // FP8_GROUP), dtype=torch.float32, device=dev) \
        if x_scale is not None else None
    bound_m = torch.full((1,), m, dtype=torch.int32, device=dev)
    torch.ops.moelink.dispatch(torch_ops.handle(a2a), rows, expert_x, expert_scale, x, x_scale,
                               one_row_if_empty(topk_ids, -1), one_row_if_empty(weights, 0),
                               bound_m)
    return rows, expert_x, expert_scale


def combine_batched(a2a: AllToAll, expert_out: torch.Tensor, topk_ids: torch.Tensor,
                    weights: torch.Tensor, m: int, max_tokens: int, out_dtype) -> torch.Tensor:
    """torch.ops.moelink.combine of expert_out [L, C, H] back to the m tokens
    of the preceding dispatch (the same topk_ids and fp32 weights): [m, H]
    out_dtype, sum_i weights[t, i] * expert output."""
    out = torch.empty((max_tokens, expert_out.shape[2]), dtype=out_dtype, device=expert_out.device)
    bound_m = torch.full((1,), m, dtype=torch.int32, device=expert_out.device)
    torch.ops.moelink.combine(torch_ops.handle(a2a), out, one_row_if_empty(topk_ids, -1),
                              one_row_if_empty(weights, 0), expert_out, bound_m)
    return out[:m]
