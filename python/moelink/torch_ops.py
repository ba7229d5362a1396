"""moelink's dispatch, combine and expert MLP as torch.library custom ops.

    import moelink, moelink.torch_ops as ops
    a2a = moelink.AllToAll(..., backend="nvlink", group=pg)
    h = ops.handle(a2a)                          # an int that names a2a inside traced code
    torch.ops.moelink.dispatch(h, out_num, out_x, out_x_scale, x, x_scale, idx, w, bound_m)
    torch.ops.moelink.combine(h, out_tokens, idx, w, expert_y, bound_m)

The ops are what torch.compile (dynamo, AOT autograd, inductor) and the CUDA
graphs of vLLM and SGLang see: each has a schema that names the tensors it
writes (the out_* arguments, written in place, nothing returned) and a fake
(meta) implementation that only checks what it can see in the shapes, so
tracing never calls into moelink. At run time each op calls the object's
method on torch's current stream of the tensors' device (host backends: no
stream). Arguments, shapes and dtypes are those of AllToAll.dispatch /
combine and Experts.forward (docs/python.md).

Objects cross the op boundary as integer handles (a torch schema has no type
for a Python object): handle(obj) gives the same int for the life of obj and
holds obj only weakly, so a handle outlives nothing. Importing this module
imports torch; `import moelink` alone does not."""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import torch

from ._all_to_all import AllToAll
from ._experts import Experts

__all__ = ["handle", "lookup", "dispatch", "combine", "experts_forward"]

_lock = threading.Lock()
_next_handle = itertools.count(1)  # 0 is never a handle: an unset int field reads as 0
_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handles: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def handle(obj) -> int:
    """The op handle of a moelink.AllToAll or moelink.Experts (stable for the
    object's life; never reused for another object in this process)."""
    if not isinstance(obj, (AllToAll, Experts)):
        raise TypeError("moelink.torch_ops.handle: obj must be a moelink.AllToAll or "
                        f"moelink.Experts, got {type(obj).__name__}")
    with _lock:
        h = _handles.get(obj)
        if h is None:
            h = next(_next_handle)
            _handles[obj] = h
            _objects[h] = obj
        return h


def lookup(h: int, kind: type = object):
    """The live object behind handle h; a clear error for an unknown or dead
    handle or one of the wrong kind."""
    with _lock:
        obj = _objects.get(int(h))
    if obj is None:
        raise ValueError(f"moelink.torch_ops: handle = {h} names no live moelink object "
                         "(get one from moelink.torch_ops.handle(obj) and keep obj alive)")
    if not isinstance(obj, kind):
        raise TypeError(f"moelink.torch_ops: handle = {h} names a {type(obj).__name__}, "
                        f"this op needs a {kind.__name__}")
    return obj


def _check_fake(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    # Shape errors a traced graph can state without running moelink; the
    # values (counts, routes) are checked by the real call.
    if t.dim() != ndim:
        raise ValueError(f"moelink::{op}: {name} must have {ndim} dimensions, "
                         f"got shape {tuple(t.shape)}")


# ---------------------------------------------------------------- dispatch
@torch.library.custom_op("moelink::dispatch",
                         mutates_args=("out_expert_num_tokens", "out_expert_x",
                                       "out_expert_x_scale"))
def dispatch(a2a: int, out_expert_num_tokens: torch.Tensor, out_expert_x: torch.Tensor,
             out_expert_x_scale: Optional[torch.Tensor], dp_x: torch.Tensor,
             dp_x_scale: Optional[torch.Tensor], indices: torch.Tensor, weights: torch.Tensor,
             bound_m: torch.Tensor, do_send: bool = True, do_recv: bool = True) -> None:
    """AllToAll.dispatch of the AllToAll with handle a2a: writes
    out_expert_num_tokens [L] int32, out_expert_x [L, C, H] and
    out_expert_x_scale [L, C, S] (None when S == 0) from dp_x [T', H],
    dp_x_scale [T', S] or None, indices [T', k], weights [T', k] fp32 and
    bound_m [1] int32."""
    lookup(a2a, AllToAll).dispatch(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                                   dp_x_scale, indices, weights, bound_m, do_send=do_send,
                                   do_recv=do_recv)


@dispatch.register_fake
def _dispatch_fake(a2a, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                   indices, weights, bound_m, do_send=True, do_recv=True) -> None:
    _check_fake("dispatch", "out_expert_num_tokens", out_expert_num_tokens, 1)
    _check_fake("dispatch", "out_expert_x", out_expert_x, 3)
    _check_fake("dispatch", "dp_x", dp_x, 2)
    _check_fake("dispatch", "indices", indices, 2)
    _check_fake("dispatch", "weights", weights, 2)
    return None


# ---------------------------------------------------------------- combine
@torch.library.custom_op("moelink::combine", mutates_args=("out_tokens",))
def combine(a2a: int, out_tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
            expert_y: torch.Tensor, bound_m: torch.Tensor, do_send: bool = True,
            do_recv: bool = True, accumulate: bool = False) -> None:
    """AllToAll.combine of the AllToAll with handle a2a: out_tokens[t] =
    sum_i weights[t, i] * expert_y(t, i) (+ out_tokens[t] when accumulate)
    for t < m; expert_y [L, C, H], the rest as in dispatch."""
    lookup(a2a, AllToAll).combine(out_tokens, indices, weights, expert_y, bound_m,
                                  do_send=do_send, do_recv=do_recv, accumulate=accumulate)


@combine.register_fake
def _combine_fake(a2a, out_tokens, indices, weights, expert_y, bound_m, do_send=True,
                  do_recv=True, accumulate=False) -> None:
    _check_fake("combine", "out_tokens", out_tokens, 2)
    _check_fake("combine", "indices", indices, 2)
    _check_fake("combine", "weights", weights, 2)
    _check_fake("combine", "expert_y", expert_y, 3)
    return None


# ---------------------------------------------------------------- experts
@torch.library.custom_op("moelink::experts_forward", mutates_args=("expert_y",))
def experts_forward(experts: int, expert_y: torch.Tensor, expert_num_tokens: torch.Tensor,
                    expert_x: torch.Tensor, expert_x_scale: torch.Tensor, w13: torch.Tensor,
                    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> None:
    """Experts.forward of the Experts with handle `experts`: expert_y
    [L, C, H] bf16 from expert_x [L, C, H] fp8 with expert_x_scale
    [L, C, H/128], w13 [L, 2I, H] fp8 + w13_scale, w2 [L, H, I] fp8 +
    w2_scale, for rows r < expert_num_tokens[l]."""
    lookup(experts, Experts).forward(expert_y, expert_num_tokens, expert_x, expert_x_scale, w13,
                                     w13_scale, w2, w2_scale)


@experts_forward.register_fake
def _experts_forward_fake(experts, expert_y, expert_num_tokens, expert_x, expert_x_scale, w13,
                          w13_scale, w2, w2_scale) -> None:
    _check_fake("experts_forward", "expert_y", expert_y, 3)
    _check_fake("experts_forward", "expert_x", expert_x, 3)
    _check_fake("experts_forward", "w13", w13, 3)
    _check_fake("experts_forward", "w2", w2, 3)
    if expert_y.shape[:2] != expert_x.shape[:2]:
        raise ValueError("moelink::experts_forward: expert_y and expert_x must agree in [L, C], "
                         f"got {tuple(expert_y.shape)} and {tuple(expert_x.shape)}")
    return None
