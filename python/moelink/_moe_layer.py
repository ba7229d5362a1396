"""The Python-facing MoELayer: resolves the model, the bootstrap and the CUDA
stream, then calls the C++ binding (which releases the GIL while it runs)."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from ._all_to_all import _resolve_bootstrap, stream_handle, sync_cuda_device
from ._config import resolve_config

_OVERLAPS = ("auto", "none", "dispatch-overlap", "micro-batch")
_HOST_BACKENDS = ("cpu", "internode-cpu")


def model_config(model: Any = "deepseek-v3", **overrides) -> "_C.MoEModelConfig":
    """A moelink.MoEModelConfig from a preset name ("deepseek-v3",
    "deepseek-r1", "kimi-k2", "qwen3-235b-a22b", "mixtral-8x7b"), a Hugging
    Face config (a dict, a transformers PretrainedConfig, or a config.json
    path), or a MoEModelConfig; keyword arguments override its fields."""
    return resolve_config(_C.MoEModelConfig, model, overrides, "MoELayer: unknown model field")


class MoELayer:
    """A whole MoE layer: router, 1x128 fp8 quantization, dispatch, shared
    expert, expert GEMMs, combine (docs/moe_layer.md).

    MoELayer(model="deepseek-v3", *, max_tokens, backend="nvlink", overlap="auto",
             micro_batch_min_tokens=32, cuda_graphs=False, dp_size=1, group=None,
             bootstrap=None, timeout_s=None, debug=None, profile=None, share_with=None,
             **model_fields)

    Collective over the ranks (the same bootstrap rules as AllToAll). Give it
    weights with set_weights() or load_checkpoint(), then call forward().
    share_with=other: use other's AllToAlls, expert kernels and workspaces
    (only the weights are this layer's; no collective), for layers called one
    after another on one stream; the same shapes and options are required."""

    def __init__(self, model: Any = "deepseek-v3", *, max_tokens: int, backend: str = "nvlink",
                 overlap: str = "auto", micro_batch_min_tokens: int = 32, cuda_graphs: bool = False,
                 dp_size: int = 1, group=None, bootstrap=None, timeout_s: Optional[float] = None,
                 debug: Optional[bool] = None, profile: Optional[bool] = None,
                 share_with: Optional["MoELayer"] = None, **model_fields):
        if overlap not in _OVERLAPS:
            raise ValueError(f"moelink: MoELayer: overlap = {overlap!r} must be one of "
                             + ", ".join(repr(o) for o in _OVERLAPS))
        cfg = model_config(model, **model_fields)
        self._host = backend in _HOST_BACKENDS
        if not self._host:
            sync_cuda_device()
        self._bootstrap = _resolve_bootstrap(group, bootstrap, timeout_s)
        self._impl = _C.MoELayer(cfg, self._bootstrap, int(max_tokens), backend, overlap,
                                 int(micro_batch_min_tokens), bool(cuda_graphs), int(dp_size),
                                 -1.0 if timeout_s is None else float(timeout_s),
                                 -1 if debug is None else int(bool(debug)),
                                 -1 if profile is None else int(bool(profile)),
                                 None if share_with is None else share_with._impl)

    def _stream(self, stream, like) -> int:
        return 0 if self._host else stream_handle(stream, like)

    def set_weights(self, gate, w13, w2, *, gate_bias=None, w13_scale=None, w2_scale=None,
                    shared_w13=None, shared_w13_scale=None, shared_w2=None,
                    shared_w2_scale=None) -> None:
        """This rank's weights (host or device tensors; copied in): gate [E, H]
        bf16/fp32, gate_bias [E] fp32, w13 [L, 2I, H] (gate rows, then up rows)
        and w2 [L, H, I] as fp8 with their 128x128 block scales or bf16/fp32
        (quantized here), shared_w13 [2Is, H] and shared_w2 [H, Is] likewise."""
        self._impl.set_weights(gate, gate_bias, w13, w13_scale, w2, w2_scale, shared_w13,
                               shared_w13_scale, shared_w2, shared_w2_scale)

    def load_checkpoint(self, directory: str, layer_index: int) -> None:
        """Layer `layer_index` of a Hugging Face checkpoint directory
        (safetensors; fp8 with weight_scale_inv, or bf16): the router, this
        rank's experts and the shared experts."""
        self._impl.load_checkpoint(str(directory), int(layer_index))

    def forward(self, out, x, bound_m, stream=None, num_tokens: int = 0) -> None:
        """out [m', H] bf16 = MoE(x [m', H] bf16) for rows < bound_m[0];
        num_tokens: what the host knows of m (picks the mode and the graph
        bucket; every rank must pass the same)."""
        self._impl.forward(out, x, bound_m, self._stream(stream, x), int(num_tokens))

    def stage_begin(self, part: int, out, x, bound_m, stream=None) -> None:
        """Micro-batch `part` (0 or 1) in stages, for a caller interleaving
        two micro-batches with its own work (MoELayer::stage_begin): quantize,
        route, dispatch send, the shared expert (out = its output). out, x
        and bound_m as forward()'s, at most ceil(T/2) rows (part 0) or
        floor(T/2) (part 1); keep them alive and untouched until
        stage_end(part). Needs the micro-batch AllToAlls (overlap
        "micro-batch", or "auto" across nodes from micro_batch_min_tokens)."""
        self._impl.stage_begin(int(part), out, x, bound_m, self._stream(stream, x))

    def stage_middle(self, part: int, stream=None) -> None:
        """Dispatch receive, the routed experts, combine send."""
        self._impl.stage_middle(int(part), 0 if self._host else stream_handle(stream, None))

    def stage_end(self, part: int, stream=None) -> None:
        """Combine receive: out += the routed experts' sum; the part is free."""
        self._impl.stage_end(int(part), 0 if self._host else stream_handle(stream, None))

    def route(self, indices, weights, x, bound_m, stream=None) -> None:
        """The router alone: indices [m', k] int32, weights [m', k] fp32."""
        self._impl.route(indices, weights, x, bound_m, self._stream(stream, x))

    def check(self, stream=None) -> None:
        self._impl.check(0 if self._host else stream_handle(stream, None))

    def stage_times(self) -> dict:
        """Microseconds per stage of the last forward() (profile=True)."""
        return self._impl.stage_times()

    def overlap_for(self, num_tokens: int) -> str:
        return self._impl.overlap_for(int(num_tokens))

    @property
    def num_local_experts(self) -> int:
        return self._impl.num_local_experts

    @property
    def model(self):
        return self._impl.model
