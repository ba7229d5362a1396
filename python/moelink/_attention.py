"""The Python-facing MLAAttention: resolves the config and the CUDA stream,
then calls the C++ binding (which releases the GIL while it runs)."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from ._all_to_all import stream_handle, sync_cuda_device
from ._config import resolve_config


def mla_config(model: Any = "deepseek-v3", **overrides) -> "_C.MLAConfig":
    """A moelink.MLAConfig from a preset name ("deepseek-v3", "deepseek-r1",
    "kimi-k2"), a Hugging Face config (a dict, a transformers
    PretrainedConfig, or a config.json path), or an MLAConfig; keyword
    arguments override its fields."""
    return resolve_config(_C.MLAConfig, model, overrides, "MLAAttention: unknown config field")


class MLAAttention:
    """DeepSeek-V3's multi-head latent attention on a paged latent KV cache
    (docs/attention.md).

    MLAAttention(config="deepseek-v3", *, max_tokens, max_requests,
                 max_pages_per_request, page_size=64, tp_size=1, tp_rank=0,
                 device="cuda", decode_kernel="auto", prefill_kernel="auto", head_gemm="bf16",
                 debug=None, share_with=None, **config_fields)

    decode_kernel (CUDA): "auto" (FlashInfer's MLA kernel where it applies:
    kv_lora_rank 512, rotary 64, an eager call or a capture with the batch's
    host copies; else moelink's own), "flashinfer", "flashmla" (FlashMLA's
    kernel: a build with its source, page_size 64, head_gemm "bf16") or
    "moelink". prefill_kernel (CUDA): "auto" (FlashInfer's
    Hopper prefill kernel where it applies: qk_nope_head_dim 128, rotary 64,
    v_head_dim 128; else moelink's own), "flashinfer" or "moelink".
    head_gemm: the absorbed decode's per-head GEMMs (q_nope through W_UK^T,
    the latent output through W_UV): "bf16" (the default: kv_b_proj
    dequantized to bf16 at load; cuBLAS's batched GEMM on CUDA) or "fp8"
    (the activations quantized 1x128, moelink's fp8 grouped GEMM; half the
    weight bytes, slower on an H100: docs/attention.md).

    share_with=other: use other's scratch (activations, GEMM and FlashInfer
    workspaces; only the weights are this layer's), for layers called one
    after another on one stream; the same config and options are required.

    Give it weights with set_weights() (Hugging Face's self_attn names) or
    load_checkpoint(), then call forward() once per step."""

    def __init__(self, config: Any = "deepseek-v3", *, max_tokens: int, max_requests: int,
                 max_pages_per_request: int, page_size: int = 64, tp_size: int = 1,
                 tp_rank: int = 0, device: str = "cuda", decode_kernel: str = "auto",
                 prefill_kernel: str = "auto", head_gemm: str = "bf16", debug: Optional[bool] = None,
                 share_with: Optional["MLAAttention"] = None, **config_fields):
        cfg = mla_config(config, **config_fields)
        self._host = device == "cpu"
        if not self._host:
            sync_cuda_device()
        self._impl = _C.MLAAttention(cfg, device, int(tp_size), int(tp_rank), int(page_size),
                                     int(max_tokens), int(max_requests), int(max_pages_per_request),
                                     -1 if debug is None else int(bool(debug)), str(decode_kernel), str(prefill_kernel),
                                     str(head_gemm),
                                     None if share_with is None else share_with._impl)

    @property
    def config(self):
        return self._impl.config

    @property
    def local_heads(self) -> int:
        """Heads on this TP rank: num_attention_heads / tp_size."""
        return self._impl.local_heads

    def set_weights(self, **tensors) -> None:
        """Weights by Hugging Face's names (all heads; this rank takes its
        slice): q_a_proj, kv_a_proj_with_mqa, q_b_proj, kv_b_proj, o_proj as fp8
        with their <name>_scale (weight_scale_inv) or bf16/fp32; q_a_layernorm,
        kv_a_layernorm and, optionally, input_layernorm."""
        self._impl.set_weights(tensors)

    def load_checkpoint(self, directory: str, layer_index: int) -> None:
        """model.layers.<layer_index>.{input_layernorm, self_attn.*} of a Hugging
        Face checkpoint directory (safetensors; fp8 with weight_scale_inv, or bf16)."""
        self._impl.load_checkpoint(str(directory), int(layer_index))

    def forward(self, out, x, kv_cache, q_start, kv_len, block_table, num_decode: int = 0,
                stream=None) -> None:
        """out [n, D] bf16 = MLA(x [n, D] bf16) for the batch's rows (this TP
        rank's partial sum when tp_size > 1); writes the new tokens' rows of
        kv_cache [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] bf16.
        q_start [B + 1], kv_len [B] and block_table [B, pages] are int32; the
        first num_decode requests decode (1 or 2 query tokens each)."""
        num_requests = int(q_start.shape[0]) - 1
        self._impl.forward(out, x, kv_cache, q_start, kv_len, block_table, num_requests,
                           int(num_decode), 0 if self._host else stream_handle(stream, x))

    def check(self, stream=None) -> None:
        """Raises moelink.InputError for a batch value the last steps had to
        skip (a page id outside the cache, a length beyond the request's pages)."""
        self._impl.check(0 if self._host else stream_handle(stream, None))
