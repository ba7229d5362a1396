"""The Python-facing AllToAll: resolves the bootstrap, the config and the CUDA
stream, then calls the C++ binding (which releases the GIL while it runs)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from . import _C
from ._C import Bootstrap, Config, EnvBootstrap
from ._torch import TorchGroupBootstrap, is_process_group

_BACKENDS = ("nvlink", "cpu", "nvshmem", "internode", "internode-cpu")
# Backends whose tensors live in host memory (no CUDA stream).
_HOST_BACKENDS = ("cpu", "internode-cpu")


def sync_cuda_device() -> None:
    """moelink links its own (static) CUDA runtime: make its current device
    the one torch considers current (nothing without torch or CUDA)."""
    torch = sys.modules.get("torch")
    if _C.with_cuda and torch is not None and torch.cuda.is_available():
        _C.cuda_set_device(torch.cuda.current_device())


def _resolve_bootstrap(group, bootstrap, timeout_s) -> Bootstrap:
    if group is not None and bootstrap is not None:
        raise ValueError("moelink: AllToAll: pass either group= or bootstrap=, not both")
    if group is not None:
        if isinstance(group, Bootstrap):
            return group
        if not is_process_group(group):
            raise TypeError("moelink: AllToAll: group must be a torch.distributed.ProcessGroup, "
                            f"got {type(group).__name__}")
        return TorchGroupBootstrap(group)
    if bootstrap is not None:
        if not isinstance(bootstrap, Bootstrap):
            raise TypeError("moelink: AllToAll: bootstrap must be a moelink.Bootstrap "
                            f"(TcpBootstrap, EnvBootstrap or a subclass), got {type(bootstrap).__name__}")
        return bootstrap
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # torchrun's MASTER_PORT is taken by torch's own store: reuse the group.
        return TorchGroupBootstrap(dist.group.WORLD)
    return EnvBootstrap(60.0 if timeout_s is None else float(timeout_s))


def stream_handle(stream: Any, like: Any = None) -> int:
    """cudaStream_t (as an int) for `stream`.

    None: torch's current stream on `like`'s device when `like` is a CUDA
    torch tensor, else 0 (the legacy default stream). int: a raw
    cudaStream_t. Objects with .cuda_stream (torch.cuda.Stream), .ptr
    (cupy.cuda.Stream) or __cuda_stream__() (CUDA stream protocol) are
    accepted."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(like, torch.Tensor) and like.is_cuda:
            return int(torch.cuda.current_stream(like.device).cuda_stream)
        return 0
    if isinstance(stream, bool):
        raise TypeError("moelink: stream must be None, an int cudaStream_t or a stream object")
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise TypeError(f"moelink: stream: cannot get a cudaStream_t from {type(stream).__name__}")


class AllToAll:
    """MoE dispatch / combine across the ranks of one node.

    AllToAll(config=None, *, backend="nvlink", group=None, bootstrap=None,
             num_blocks=0, timeout_s=None, debug=None, fabric_provider=None,
             fabric_nics=None, max_private_tokens=None, node_size=None, gpu_direct=None,
             profile=None, **config_kwargs)

    backend: "nvlink" (GPUs of one node), "nvshmem", "internode" (GPUs of
    several nodes through the host proxy and libfabric), "cpu" and
    "internode-cpu" (host tensors). fabric_provider ("efa", "shm", "tcp"),
    fabric_nics, max_private_tokens, node_size (ranks per node that exchange
    tokens directly; 1 = every peer through the NIC), gpu_direct (GPU buffers
    registered with the NIC: True, False, None = by provider) and profile
    apply to the internode backends (see docs/internode.md); None leaves the
    C++ defaults and environment.

    config: a moelink.Config, a dict of its fields, or None with the fields
    given as keyword arguments (rank and world_size then default to the
    bootstrap's). The bootstrap (setup-time collective) is, in order:
    `group` (a torch.distributed.ProcessGroup), `bootstrap` (a
    moelink.Bootstrap such as TcpBootstrap), the default torch.distributed
    group when torch.distributed is initialized, else EnvBootstrap (torchrun's
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT). Collective: every rank
    constructs it together. For backend="nvlink" the current CUDA device
    (torch's, when torch is imported) is used."""

    def __init__(self, config: Any = None, *, backend: str = "nvlink", group=None,
                 bootstrap: Optional[Bootstrap] = None, num_blocks: int = 0,
                 timeout_s: Optional[float] = None, debug: Optional[bool] = None,
                 fabric_provider: Optional[str] = None, fabric_nics: Optional[int] = None,
                 max_private_tokens: Optional[int] = None, node_size: Optional[int] = None,
                 gpu_direct: Optional[bool] = None, profile: Optional[bool] = None,
                 **config_kwargs):
        if backend not in _BACKENDS:
            raise ValueError(f"moelink: AllToAll: backend = {backend!r} must be one of "
                             + ", ".join(repr(b) for b in _BACKENDS))
        if isinstance(config, Config):
            if config_kwargs:
                raise TypeError("moelink: AllToAll: pass a Config or keyword fields, not both "
                                f"(got {sorted(config_kwargs)})")
            config.validate()  # before any collective
        elif isinstance(config, dict):
            config_kwargs = {**config, **config_kwargs}
            config = None
        elif config is not None:
            raise TypeError("moelink: AllToAll: config must be a moelink.Config or a dict, got "
                            f"{type(config).__name__}")
        if config is None and "world_size" in config_kwargs:
            Config(**config_kwargs).validate()  # fail fast, before the rendezvous

        if backend not in _HOST_BACKENDS:
            self._sync_cuda_device()
        self._bootstrap = _resolve_bootstrap(group, bootstrap, timeout_s)
        if config is None:
            config_kwargs.setdefault("rank", self._bootstrap.rank())
            config_kwargs.setdefault("world_size", self._bootstrap.world_size())
            config = Config(**config_kwargs)
        self._impl = _C.AllToAll(
            config, self._bootstrap, backend, int(num_blocks),
            -1.0 if timeout_s is None else float(timeout_s),
            -1 if debug is None else int(bool(debug)),
            fabric_provider or "",
            -1 if max_private_tokens is None else int(max_private_tokens),
            -1 if profile is None else int(bool(profile)),
            0 if fabric_nics is None else int(fabric_nics),
            -1 if node_size is None else int(node_size),
            -1 if gpu_direct is None else int(bool(gpu_direct)))
        self._backend = backend

    @staticmethod
    def _sync_cuda_device() -> None:
        sync_cuda_device()

    # ------------------------------------------------------------ properties
    @property
    def config(self) -> Config:
        return self._impl.config

    @property
    def backend(self) -> str:
        return self._impl.backend

    @property
    def buffer_bytes(self) -> int:
        """Bytes of peer-visible memory this rank allocated."""
        return self._impl.buffer_bytes

    @property
    def bootstrap(self) -> Bootstrap:
        return self._bootstrap

    @property
    def device(self) -> int:
        """CUDA device of a GPU backend (-1 for the host backends)."""
        return self._impl.device

    # ------------------------------------------------------------ calls
    def _stream(self, stream, like) -> int:
        if self._backend in _HOST_BACKENDS:
            return 0
        return stream_handle(stream, like)

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                 dp_x_scale, indices, weights, bound_m, do_send: bool = True,
                 do_recv: bool = True, stream=None) -> None:
        """Sends this DP group's tokens to the ranks holding their experts.

        dp_x [T', H] in_dtype (T' <= max_num_tokens), dp_x_scale [T', S] fp32
        or None, indices [T', k] int32/uint32/int64 (-1: no route), weights
        [T', k] fp32, bound_m [1] int32 (m valid tokens, device memory for
        nvlink). Writes out_expert_num_tokens [L] int32, out_expert_x
        [L, C, H], out_expert_x_scale [L, C, S] (or None when S == 0)."""
        self._impl.dispatch(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                            dp_x_scale, indices, weights, bound_m, bool(do_send), bool(do_recv),
                            self._stream(stream, dp_x))

    def combine(self, out_tokens, indices, weights, expert_y, bound_m, do_send: bool = True,
                do_recv: bool = True, accumulate: bool = False, stream=None) -> None:
        """Returns the expert outputs expert_y [L, C, H] to the token owners:
        out_tokens[t] = sum_i weights[t, i] * y(t, i) (+ out_tokens[t] when
        accumulate) for t < m. indices, weights, bound_m as in dispatch."""
        self._impl.combine(out_tokens, indices, weights, expert_y, bound_m, bool(do_send),
                           bool(do_recv), bool(accumulate), self._stream(stream, out_tokens))

    def phase_times(self) -> dict:
        """Microseconds per phase (pack, post, wire, unpack) of the last
        dispatch and combine, for the internode backends created with
        profile=True; zeros otherwise. Waits for the issued work."""
        return self._impl.phase_times()

    def check(self) -> None:
        """Waits for the issued work; raises moelink.InputError /
        moelink.TimeoutError for anything the backend flagged."""
        self._impl.check()

    def reset_call_order(self) -> None:
        """Forgets the halves issued since the last complete dispatch +
        combine; only for halves that never ran (recorded into a CUDA-graph
        capture that failed and was thrown away)."""
        self._impl.reset_call_order()

    def close(self) -> None:
        """Frees the buffers now (otherwise done when garbage collected)."""
        self._impl.close()

    @property
    def closed(self) -> bool:
        return self._impl.closed

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._impl.closed:
            return "moelink.AllToAll(closed)"
        return f"moelink.AllToAll(backend={self.backend!r}, {self.config!r})"
