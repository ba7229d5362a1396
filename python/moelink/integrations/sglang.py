"""moelink as SGLang's MoE all-to-all (written against SGLang 0.5.23).

SGLang has no registry of all-to-all backends; it builds its pplx dispatcher
for `--moe-a2a-backend pplx`. moelink installs an `sglang.srt.plugins` entry
point (`register` below) that, when the user switches it on, replaces that
dispatcher class with MoelinkDispatcher through SGLang's HookRegistry:

    MOELINK_SGLANG=1 python -m sglang.launch_server --model-path ... \\
        --tp 8 --ep 8 --enable-dp-attention --dp 8 \\
        --moe-a2a-backend pplx --deepep-mode low_latency

MoelinkDispatcher has SGLang's dispatcher interface (dispatch_a / dispatch_b
/ combine_a / combine_b, the split halves two-batch overlap interleaves) and
returns the low-latency (DEEPEP_LL) format: hidden_states [L, C, H] (fp8 with
1x128 fp32 scales [L, C, H/128], or the model's dtype), masked_m [L] int32
rows per local expert, expected_m. Every layer shares one moelink.AllToAll
per two-batch-overlap sub-batch (two when overlap is on), created
collectively on the EP group when the layer gets its quantization config.
The calls go through moelink.torch_ops, so torch.compile and SGLang's CUDA
graphs trace them.

Environment: MOELINK_SGLANG=1 switches the replacement on (installing
moelink alone changes nothing); MOELINK_SGLANG_BACKEND picks the moelink
backend (default: "nvlink" on one node, "internode" across nodes, "cpu"
for host tensors); SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK (SGLang's,
default 128) is the per-rank token limit, as for pplx."""

from __future__ import annotations

import logging
import os
from enum import Enum, auto
from typing import NamedTuple, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers.moe.token_dispatcher.base import (
    BaseDispatcher,
    CombineInput,
    CombineInputFormat,
    DispatchOutput,
    DispatchOutputFormat,
)
from sglang.srt.layers.moe.utils import (
    DeepEPMode,
    DispatcherOutputDtype,
    get_deepep_output_dtype,
)
from sglang.srt.runtime_context import get_parallel

from . import SGLANG_SWITCH_ENV as SWITCH_ENV
from .._all_to_all import AllToAll
from ._shared import (FP8_GROUP, check_token_limit, close_all, combine_batched,  # noqa: F401
                      dispatch_batched, one_row_if_empty, shared_all_to_all)

logger = logging.getLogger(__name__)

BACKEND_ENV = "MOELINK_SGLANG_BACKEND"
REPLACED = "sglang.srt.layers.moe.token_dispatcher.pplx.PplxDispatcher"
TBO_INIT = "sglang.srt.batch_overlap.two_batch_overlap.MaybeTboDeepEPDispatcher.__init__"


class MoelinkDispatchOutput(NamedTuple):
    """What the expert runner gets: SGLang's low-latency (masked) layout."""

    hidden_states: torch.Tensor  # [L, C, H] fp8 or the model dtype
    hidden_states_scale: Optional[torch.Tensor]  # [L, C, H/128] fp32, or None (not fp8)
    topk_ids: torch.Tensor  # [m, k] this rank's routes (global expert ids)
    topk_weights: torch.Tensor  # [m, k]
    masked_m: torch.Tensor  # [L] int32: valid rows of each local expert
    expected_m: int  # rows per expert on average (the GEMM's tile choice)

    @property
    def format(self) -> DispatchOutputFormat:
        return DispatchOutputFormat.DEEPEP_LL


class MoelinkCombineInput(NamedTuple):
    hidden_states: torch.Tensor  # [L, C, H] expert outputs in the model dtype
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def format(self) -> CombineInputFormat:
        return CombineInputFormat.DEEPEP_LL


assert isinstance(MoelinkDispatchOutput, DispatchOutput)
assert isinstance(MoelinkCombineInput, CombineInput)


# ---------------------------------------------------------------- the shared AllToAll
def _default_backend(device: torch.device) -> str:
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen
    if device.type != "cuda":
        return "cpu"
    return "internode" if get_parallel().nnodes > 1 else "nvlink"


# ---------------------------------------------------------------- the dispatcher
class _Stage(Enum):
    IDLE = auto()
    DISPATCH_SENT = auto()
    DISPATCHED = auto()
    COMBINE_SENT = auto()


class MoelinkDispatcher(BaseDispatcher):
    """SGLang's dispatcher interface on moelink.AllToAll (low-latency format
    only). Constructed by SGLang with PplxDispatcher's arguments."""

    def __init__(self, group: torch.distributed.ProcessGroup, router_topk: int,
                 permute_fusion: bool = False, num_experts: Optional[int] = None,
                 num_local_experts: Optional[int] = None, hidden_size: Optional[int] = None,
                 params_dtype: Optional[torch.dtype] = None,
                 deepep_mode: DeepEPMode = DeepEPMode.AUTO, async_finish: bool = False,
                 return_recv_hook: bool = False, runner_backend=None):
        super().__init__()
        if deepep_mode != DeepEPMode.LOW_LATENCY:
            raise NotImplementedError(
                "moelink's SGLang dispatcher returns the low-latency (masked) format only: start "
                f"SGLang with --deepep-mode low_latency (got {deepep_mode.value!r})")
        for name, value in (("num_experts", num_experts), ("num_local_experts", num_local_experts),
                            ("hidden_size", hidden_size), ("params_dtype", params_dtype)):
            if value is None:
                raise ValueError(f"moelink MoelinkDispatcher: {name} is required")
        self.group = group
        self.router_topk = int(router_topk)
        self.num_experts = int(num_experts)
        self.num_local_experts = int(num_local_experts)
        self.hidden_size = int(hidden_size)
        self.params_dtype = params_dtype
        self.deepep_mode = deepep_mode
        self.runner_backend = runner_backend  # read by get_deepep_output_dtype
        self.max_tokens_per_rank = int(envs.SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get())
        self.subbatch_index = 0  # set by the two-batch-overlap hook for the second inner
        self.quant_config: dict = {}
        self.use_fp8 = False
        self._set_dispatch_dtype()
        self._stage = _Stage.IDLE
        self._state = None

    # ------------------------------------------------------------ set-up
    def _set_dispatch_dtype(self) -> None:
        out = get_deepep_output_dtype(self)
        if out not in (DispatcherOutputDtype.BF16, DispatcherOutputDtype.FP8):
            raise NotImplementedError(
                f"moelink's SGLang dispatcher sends bf16 or fp8 tokens, not {out}")
        self.use_fp8 = out == DispatcherOutputDtype.FP8

    def set_quant_config(self, quant_config: dict) -> None:
        super().set_quant_config(quant_config)
        self.quant_config = quant_config
        self._set_dispatch_dtype()
        # Collective: every rank's layers reach this in the same order at
        # load time, never inside a CUDA-graph capture.
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self._all_to_all(device)

    def _all_to_all(self, device: torch.device) -> AllToAll:
        in_dtype = torch.float8_e4m3fn if self.use_fp8 else self.params_dtype
        backend = _default_backend(device)
        cfg = dict(max_num_tokens=self.max_tokens_per_rank, num_experts=self.num_experts,
                   experts_per_token=self.router_topk, hidden_dim=self.hidden_size,
                   hidden_dim_scale=self.hidden_size // FP8_GROUP if self.use_fp8 else 0,
                   in_dtype=in_dtype, out_dtype=self.params_dtype,
                   dp_size=get_parallel().attn_tp_size)
        key = (backend, tuple(sorted((k, str(v)) for k, v in cfg.items())), self.subbatch_index)
        return shared_all_to_all(
            key, lambda: AllToAll(backend=backend, group=self.group, **cfg))

    def _advance(self, expected: _Stage, new: _Stage, call: str) -> None:
        if self._stage != expected:
            raise RuntimeError(f"moelink MoelinkDispatcher: {call} called after "
                               f"{self._stage.name}, expected after {expected.name}")
        self._stage = new

    def _check_tokens(self, m: int, call: str) -> None:
        check_token_limit(m, self.max_tokens_per_rank, f"MoelinkDispatcher.{call}",
                          "raise SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK or lower the decode "
                          "batch / chunked-prefill size")

    def _quantize(self, x: torch.Tensor):
        if not self.use_fp8:
            return x, None
        from sglang.srt.layers.quantization.fp8_kernel import sglang_per_token_group_quant_fp8

        q, s = sglang_per_token_group_quant_fp8(x, group_size=FP8_GROUP)
        return q, s.to(torch.float32)

    # ------------------------------------------------------------ dispatch
    def dispatch(self, hidden_states: torch.Tensor, topk_output) -> DispatchOutput:
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output) -> None:
        """hidden_states [m, H] in the model dtype; topk_output.topk_ids
        [m, k] (global expert ids, -1: none), .topk_weights [m, k]."""
        self._advance(_Stage.IDLE, _Stage.DISPATCH_SENT, "dispatch_a")
        try:
            m = hidden_states.shape[0]
            self._check_tokens(m, "dispatch_a")
            a2a = self._all_to_all(hidden_states.device)
            x, x_scale = self._quantize(one_row_if_empty(hidden_states, 0))
            masked_m, out_x, out_scale = dispatch_batched(
                a2a, self.num_local_experts, x, x_scale, topk_output.topk_ids,
                topk_output.topk_weights.to(torch.float32), m)
            num_dp_groups = get_parallel().attn_dp_size
            expected_m = (m * num_dp_groups * self.router_topk + self.num_experts) // \
                self.num_experts
        except BaseException:
            self._stage = _Stage.IDLE  # a rejected call leaves the dispatcher usable
            raise
        self._state = (out_x, out_scale, topk_output.topk_ids, topk_output.topk_weights,
                       masked_m, expected_m)

    def dispatch_b(self) -> MoelinkDispatchOutput:
        self._advance(_Stage.DISPATCH_SENT, _Stage.DISPATCHED, "dispatch_b")
        state, self._state = self._state, None
        get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(state[4])
        return MoelinkDispatchOutput(*state)

    # ------------------------------------------------------------ combine
    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input: CombineInput) -> None:
        """combine_input: (hidden_states [L, C, H] expert outputs, topk_ids,
        topk_weights) as dispatch_b returned them."""
        hidden_states, topk_ids, topk_weights = combine_input
        self._advance(_Stage.DISPATCHED, _Stage.COMBINE_SENT, "combine_a")
        try:
            m = topk_ids.shape[0]
            self._check_tokens(m, "combine_a")
            a2a = self._all_to_all(hidden_states.device)
            out = combine_batched(a2a, hidden_states, topk_ids, topk_weights.to(torch.float32), m,
                                  self.max_tokens_per_rank, self.params_dtype)
        except BaseException:
            self._stage = _Stage.DISPATCHED
            raise
        self._state = out

    def combine_b(self) -> torch.Tensor:
        """[m, H] in the model dtype: sum_i topk_weights[t, i] * expert output."""
        self._advance(_Stage.COMBINE_SENT, _Stage.IDLE, "combine_b")
        out, self._state = self._state, None
        return out


# ---------------------------------------------------------------- the plugin
def _number_tbo_inners(original_init, self, *args, **kwargs):
    # Two-batch overlap builds one inner dispatcher per sub-batch; each needs
    # its own AllToAll, shared with the same sub-batch of every other layer.
    original_init(self, *args, **kwargs)
    for i, inner in enumerate(getattr(self, "_inners", ())):
        if isinstance(inner, MoelinkDispatcher):
            inner.subbatch_index = i


def register() -> None:
    """The `sglang.srt.plugins` entry point: with MOELINK_SGLANG=1, SGLang's
    pplx dispatcher becomes MoelinkDispatcher (`--moe-a2a-backend pplx`)."""
    if os.environ.get(SWITCH_ENV, "0") != "1":
        logger.debug("moelink: %s is not 1, SGLang's dispatchers are left alone", SWITCH_ENV)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(REPLACED, MoelinkDispatcher, HookType.REPLACE)
    HookRegistry.register(TBO_INIT, _number_tbo_inners, HookType.AROUND)
    logger.info("moelink: --moe-a2a-backend pplx now runs on moelink (MoelinkDispatcher)")
