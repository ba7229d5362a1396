"""What the engine integrations share: one moelink.AllToAll per
configuration (every MoE layer of a sub-batch uses it; its buffers are the
biggest allocation moelink makes), the backend choice and the 1x128 fp8
quantization of tokens before dispatch."""

from __future__ import annotations

import threading

import torch

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
