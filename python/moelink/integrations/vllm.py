"""moelink as vLLM's MoE all-to-all (written against vLLM 0.33).

vLLM composes a fused MoE from a prepare/finalize object (dispatch and
combine) and an experts object. MoelinkPrepareAndFinalize is a
FusedMoEPrepareAndFinalizeModular on moelink.AllToAll in the batched-experts
format DeepEP's low-latency kernels use: prepare() returns the tokens each
local expert received, [L, C, H] (fp8 with 1x128 fp32 scales [L, C, H/128],
or the model dtype) and the rows per expert [L] int32; finalize() sums each
token's weighted expert outputs back on its own rank (the output is
reduced). Every layer shares one moelink.AllToAll per configuration.

moelink installs a `vllm.general_plugins` entry point (`register` below)
that, when the user switches it on, makes vLLM's choice of prepare/finalize
return MoelinkPrepareAndFinalize wherever it would build DeepEP's
low-latency one:

    MOELINK_VLLM=1 vllm serve ... --enable-expert-parallel \\
        --all2all-backend deepep_low_latency

Environment: MOELINK_VLLM=1 switches the replacement on (installing moelink
alone changes nothing); MOELINK_VLLM_BACKEND picks the moelink backend
(default: "nvlink" for CUDA tensors on one node, "internode" across nodes,
"cpu" for host tensors)."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

from .._all_to_all import AllToAll
from ._shared import (FP8_GROUP, check_token_limit, combine_batched, dispatch_batched,
                      one_row_if_empty, quantize_fp8_groups, shared_all_to_all)

BACKEND_ENV = "MOELINK_VLLM_BACKEND"


def _default_backend(device: torch.device, nnodes: int) -> str:
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen
    if device.type != "cuda":
        return "cpu"
    return "internode" if nnodes > 1 else "nvlink"


class MoelinkPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize on moelink.AllToAll (batched-experts format).

    group: the EP process group (all ranks that hold experts); num_dispatchers:
    the ranks whose tokens reach an expert (the group's size divided by
    dp_size, the ranks sharing one attention replica); max_tokens_per_rank:
    the most tokens one rank dispatches in a call."""

    def __init__(self, group: torch.distributed.ProcessGroup, *, max_tokens_per_rank: int,
                 num_experts: int, experts_per_token: int, hidden_size: int,
                 params_dtype: torch.dtype, num_dispatchers: int, dp_size: int = 1,
                 use_fp8_dispatch: bool = False, backend: Optional[str] = None, nnodes: int = 1):
        super().__init__()
        world = torch.distributed.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"moelink MoelinkPrepareAndFinalize: num_experts = {num_experts} "
                             f"must be a multiple of the EP group's {world} ranks")
        if use_fp8_dispatch and hidden_size % FP8_GROUP:
            raise ValueError(f"moelink MoelinkPrepareAndFinalize: fp8 dispatch needs hidden_size "
                             f"= {hidden_size} to be a multiple of {FP8_GROUP}")
        self.group = group
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.num_experts = int(num_experts)
        self.num_local_experts = self.num_experts // world
        self.experts_per_token = int(experts_per_token)
        self.hidden_size = int(hidden_size)
        self.params_dtype = params_dtype
        self.num_dispatchers_ = int(num_dispatchers)
        self.dp_size = int(dp_size)
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.backend = backend
        self.nnodes = int(nnodes)
        self._combine_state = None

    # ------------------------------------------------------------ what vLLM asks
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.max_tokens_per_rank

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return torch.int32

    def num_dispatchers(self) -> int:
        return self.num_dispatchers_

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return True

    def all_to_all(self, device: torch.device) -> AllToAll:
        """The AllToAll every layer of this configuration shares (created
        collectively on the EP group the first time)."""
        in_dtype = torch.float8_e4m3fn if self.use_fp8_dispatch else self.params_dtype
        backend = self.backend or _default_backend(device, self.nnodes)
        cfg = dict(max_num_tokens=self.max_tokens_per_rank, num_experts=self.num_experts,
                   experts_per_token=self.experts_per_token, hidden_dim=self.hidden_size,
                   hidden_dim_scale=self.hidden_size // FP8_GROUP if self.use_fp8_dispatch else 0,
                   in_dtype=in_dtype, out_dtype=self.params_dtype, dp_size=self.dp_size)
        key = ("vllm", backend, id(self.group), tuple(sorted((k, str(v)) for k, v in cfg.items())))
        return shared_all_to_all(key, lambda: AllToAll(backend=backend, group=self.group, **cfg))

    def _check_tokens(self, m: int, call: str) -> None:
        check_token_limit(m, self.max_tokens_per_rank, f"MoelinkPrepareAndFinalize.{call}",
                          "max_tokens_per_rank is vLLM's max_num_tokens of the MoE config")

    @staticmethod
    def _route_weights(topk_weights: torch.Tensor, applied_on_input: bool) -> torch.Tensor:
        # The combine sums with the weights the dispatch was given (the
        # AllToAll's contract: the same values for both halves); ones when
        # prepare already scaled the tokens.
        w = topk_weights.to(torch.float32)
        return torch.ones_like(w) if applied_on_input else w

    # ------------------------------------------------------------ dispatch
    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: Optional[torch.Tensor],
                      apply_router_weight_on_input: bool, quant_config: FusedMoEQuantConfig,
                      defer_input_quant: bool = False) -> tuple[Callable, mk.ReceiverType]:
        """a1 [m, H] in the model dtype; topk_ids [m, k] global expert ids
        (-1: none), topk_weights [m, k]. expert_map is not needed: moelink
        routes by global id and each rank holds experts rank * L .. + L - 1."""
        if defer_input_quant:
            raise NotImplementedError("moelink MoelinkPrepareAndFinalize quantizes before the "
                                      "dispatch; defer_input_quant=True is not supported")
        if num_experts != self.num_experts:
            raise ValueError(f"moelink MoelinkPrepareAndFinalize.prepare: num_experts = {num_experts}, "
                             f"expected {self.num_experts}")
        m = a1.shape[0]
        self._check_tokens(m, "prepare")
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("moelink MoelinkPrepareAndFinalize.prepare: "
                                 "apply_router_weight_on_input needs top-1 routing")
            a1 = a1 * topk_weights.to(a1.dtype)
        a2a = self.all_to_all(a1.device)
        x = one_row_if_empty(a1, 0)
        x_scale = None
        if self.use_fp8_dispatch:
            x, x_scale = quantize_fp8_groups(x)
        rows, expert_x, expert_scale = dispatch_batched(
            a2a, self.num_local_experts, x, x_scale, topk_ids.to(torch.int32),
            self._route_weights(topk_weights, apply_router_weight_on_input), m)

        def receiver() -> mk.PrepareResultType:
            meta = mk.ExpertTokensMetadata(expert_num_tokens=rows, expert_num_tokens_cpu=None)
            return expert_x, expert_scale, meta, None, None

        return (lambda: None), receiver

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config,
                                            defer_input_quant)
        hook()
        return receiver()

    # ------------------------------------------------------------ combine
    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce) -> tuple[Callable, Callable]:
        """output [m, H] = sum_i topk_weights[t, i] * fused_expert_output of
        token t's i-th expert (from the rank that holds it); the weights are
        applied here, in moelink's combine."""
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError("moelink MoelinkPrepareAndFinalize.finalize applies the top-k weights "
                             "in its combine: the experts must delegate weight-and-reduce to it")
        m = topk_ids.shape[0]
        self._check_tokens(m, "finalize")
        a2a = self.all_to_all(fused_expert_output.device)
        expert_out = fused_expert_output
        C = a2a.config.expert_capacity
        if expert_out.shape[1] != C:
            expert_out = expert_out[:, :C].contiguous()
        combined = combine_batched(a2a, expert_out.to(self.params_dtype), topk_ids.to(torch.int32),
                                   self._route_weights(topk_weights, apply_router_weight_on_input),
                                   m, self.max_tokens_per_rank, self.params_dtype)

        def receiver() -> None:
            output.copy_(combined)

        return (lambda: None), receiver

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl) -> None:
        hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl)
        hook()
        receiver()


# ---------------------------------------------------------------- the plugin
def make_for(moe, quant_config, all2all_manager=None) -> MoelinkPrepareAndFinalize:
    """MoelinkPrepareAndFinalize for vLLM's FusedMoEConfig `moe` on its EP
    group (what maybe_make_prepare_finalize builds when switched on)."""
    from vllm.distributed import get_ep_group
    from vllm.platforms import current_platform

    ep = get_ep_group()
    use_fp8 = quant_config is not None and \
        quant_config.quant_dtype == current_platform.fp8_dtype() and \
        list(quant_config.block_shape or []) == [FP8_GROUP, FP8_GROUP]
    group = ep.device_group if torch.cuda.is_available() else ep.cpu_group
    nnodes = int(os.environ.get("MOELINK_VLLM_NNODES", "1"))
    # As for DeepEP's low-latency kernels: every rank of the EP group
    # dispatches its own tokens.
    return MoelinkPrepareAndFinalize(
        group, max_tokens_per_rank=moe.max_num_tokens, num_experts=moe.num_experts,
        experts_per_token=moe.experts_per_token, hidden_size=moe.hidden_dim,
        params_dtype=moe.in_dtype, num_dispatchers=ep.world_size, use_fp8_dispatch=use_fp8,
        nnodes=nnodes)


def register() -> None:
    """Wraps vLLM's maybe_make_prepare_finalize (in all2all_utils and in every
    module already holding it) so that where it would build DeepEP's
    low-latency prepare/finalize it returns MoelinkPrepareAndFinalize."""
    from vllm.model_executor.layers.fused_moe import all2all_utils

    original = all2all_utils.maybe_make_prepare_finalize
    if getattr(original, "_moelink", False):
        return

    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        if moe.moe_parallel_config.use_all2all_kernels and moe.use_deepep_ll_kernels:
            return make_for(moe, quant_config, kwargs.get("all2all_manager"))
        return original(moe, quant_config, *args, **kwargs)

    maybe_make_prepare_finalize._moelink = True
    # A module's own dict, not getattr: lazy modules (transformers' aliases)
    # import on attribute access, which may need packages that are absent.
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("maybe_make_prepare_finalize") is original:
            module.maybe_make_prepare_finalize = maybe_make_prepare_finalize
