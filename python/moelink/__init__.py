"""moelink: Mixture-of-Experts all-to-all (dispatch / combine) for the GPUs
(or, for testing, the processes) of one node.

    import moelink
    a2a = moelink.AllToAll(max_num_tokens=128, num_experts=256, experts_per_token=8,
                           hidden_dim=7168, hidden_dim_scale=56, in_dtype="fp8",
                           out_dtype="bf16", backend="nvlink", group=pg)
    a2a.dispatch(...); a2a.combine(...)

torch is optional: it is imported only when a torch object is passed in."""

from __future__ import annotations

from . import _C
from ._C import (
    Bootstrap,
    Config,
    MoEModelConfig,
    EnvBootstrap,
    Error,
    InputError,
    InvalidArgument,
    MLAConfig,
    ModelConfig,
    RopeScaling,
    SystemError,
    TcpBootstrap,
    TimeoutError,
    env_local_rank,
    with_cuda,
)
from ._all_to_all import AllToAll, stream_handle
from ._attention import MLAAttention, mla_config
from ._experts import Experts
from ._engine import Engine
from . import serve
from ._model import Model, model_full_config
from ._moe_layer import MoELayer, model_config
from ._torch import TorchGroupBootstrap

with_fabric = _C.with_fabric
if with_fabric:  # the TransferEngine and KV-cache transfer (docs/transfer_engine.md)
    from ._C import (
        KvCacheLayout,
        KvTransferRequest,
        MemoryDescriptor,
        MemoryRegion,
        Transfer,
        TransferEngine,
        kv_request_bytes,
    )

__version__ = _C.version  # include/moelink/version.h

__all__ = [
    "AllToAll",
    "Bootstrap",
    "Config",
    "EnvBootstrap",
    "Error",
    "Experts",
    "MLAAttention",
    "MLAConfig",
    "mla_config",
    "MoELayer",
    "Model",
    "Engine",
    "ModelConfig",
    "model_full_config",
    "model_config",
    "InputError",
    "InvalidArgument",
    "MoEModelConfig",
    "TcpBootstrap",
    "TorchGroupBootstrap",
    "env_local_rank",
    "stream_handle",
    "with_cuda",
    "with_fabric",
]
if with_fabric:
    __all__ += ["KvCacheLayout", "KvTransferRequest", "MemoryDescriptor", "MemoryRegion", "Transfer",
                "TransferEngine", "kv_request_bytes"]
