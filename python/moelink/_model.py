"""The Python-facing Model: resolves the config, the bootstrap and the CUDA
stream, then calls the C++ binding (which releases the GIL while it runs)."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from ._all_to_all import _resolve_bootstrap, stream_handle, sync_cuda_device
from ._config import resolve_config

_HOST_BACKENDS = ("cpu", "internode-cpu")


def model_full_config(model: Any = "deepseek-v3", **overrides) -> "_C.ModelConfig":
    """A moelink.ModelConfig from a preset ("deepseek-v3", "deepseek-r1",
    "kimi-k2"), a Hugging Face config (dict, PretrainedConfig or config.json
    path) or a ModelConfig; keyword arguments override its top-level fields."""
    return resolve_config(_C.ModelConfig, model, overrides, "Model: unknown config field")


class Model:
    """A DeepSeek-V3-family model from token ids to next tokens
    (docs/model.md): embedding, MLA attention and MoE (or dense) layers,
    lm_head, sampling.

    Model(config, *, max_tokens, num_pages, backend="nvlink", page_size=64,
          max_requests=64, max_pages_per_request=64, num_layers=0, overlap="auto",
          dp_size=1, tp_size=1, tp_rank=0, mtp=False, decode_graphs=False,
          decode_kernel="auto", prefill_kernel="auto", head_gemm="bf16", group=None,
          bootstrap=None, timeout_s=None, debug=None)

    mtp=True also runs the checkpoint's MTP module on every step: step()
    then proposes a draft token per request (draft_tokens=), which the next
    step verifies (num_drafts=). decode_graphs=True (GPU backends) runs the
    serving engine's decode-only steps through one CUDA graph per batch-size
    bucket (ModelOptions.decode_graphs). decode_kernel and prefill_kernel
    pick every layer's attention kernels as in moelink.MLAAttention
    ("auto", "flashinfer", "flashmla" (decode only), "moelink"; GPU backends), head_gemm the absorbed
    decode's W_UK / W_UV GEMMs ("bf16" or "fp8", as in MLAAttention).

    Collective over the ranks (expert parallelism; the same bootstrap rules
    as AllToAll). Load weights with load_checkpoint(), then call step()."""

    def __init__(self, config: Any = "deepseek-v3", *, max_tokens: int, num_pages: int,
                 backend: str = "nvlink", page_size: int = 64, max_requests: int = 64,
                 max_pages_per_request: int = 64, num_layers: int = 0, overlap: str = "auto",
                 dp_size: int = 1, tp_size: int = 1, tp_rank: int = 0, mtp: bool = False,
                 decode_graphs: bool = False, decode_kernel: str = "auto", prefill_kernel: str = "auto",
                 head_gemm: str = "bf16", group=None, bootstrap=None, timeout_s: Optional[float] = None,
                 debug: Optional[bool] = None):
        cfg = model_full_config(config)
        self._host = backend in _HOST_BACKENDS
        self.page_size, self.num_pages, self.mtp = int(page_size), int(num_pages), bool(mtp)
        if not self._host:
            sync_cuda_device()
        self._bootstrap = _resolve_bootstrap(group, bootstrap, timeout_s)
        self._impl = _C.Model(cfg, self._bootstrap, int(max_tokens), backend, overlap, int(dp_size),
                              -1.0 if timeout_s is None else float(timeout_s),
                              -1 if debug is None else int(bool(debug)), int(num_layers),
                              int(num_pages), int(page_size), int(max_requests),
                              int(max_pages_per_request), int(tp_size), int(tp_rank), bool(mtp),
                              bool(decode_graphs), str(decode_kernel), str(prefill_kernel), str(head_gemm))

    @property
    def config(self):
        return self._impl.config

    @property
    def num_layers(self) -> int:
        return self._impl.num_layers

    @property
    def decode_graph_stats(self) -> dict:
        """How step_from_host's decode-only steps ran with decode_graphs=True
        (moelink::DecodeGraphStats): replays, eager_steps (a bucket's first
        step, a failed capture, or a batch FlashInfer schedules on another
        grid), captures; host_seconds and wait_seconds, those steps' host
        clock split where their work is queued (the host's part: layout,
        copies, plans, launch / the wait for the device and the results);
        zeros without decode_graphs."""
        return self._impl.decode_graph_stats

    @property
    def two_batch_steps(self) -> int:
        """Steps whose MoE layers ran as two micro-batches interleaved across
        attention and MoE (moelink::Model::two_batch_steps): with overlap
        "micro-batch" (or "auto" on a backend whose exchange may cross
        nodes, across ranks, from micro_batch_min_tokens max_tokens) and the
        step's q_start on the host."""
        return self._impl.two_batch_steps

    def kv_cache_region(self):
        """Every layer's KV cache as one uint8 array (numpy on a host backend,
        a torch tensor on a GPU one), layer after layer: register it once with
        a TransferEngine to move a request's pages (P/D disaggregation).
        Layout: moelink.KvCacheLayout.layer_major(caches, Dc * 2, page_size,
        num_pages), caches = num_layers (+ 1 with mtp)."""
        return self._impl.kv_cache_region()

    def load_checkpoint(self, directory: str) -> None:
        """A Hugging Face checkpoint directory (safetensors; fp8 with
        weight_scale_inv, or bf16/fp32): this rank's share of every layer run."""
        self._impl.load_checkpoint(str(directory))

    def step(self, token_ids, q_start, kv_len, block_table, next_tokens, *, num_decode: int = 0,
             logits=None, logits_every_row: bool = False, temperature=None, top_k=None,
             top_p=None, seed=None, num_drafts=None, known_next=None, accepted=None,
             draft_tokens=None, draft_logits=None, stream=None) -> None:
        """One step over this rank's requests. token_ids [n] int32 are the
        query tokens; q_start [B + 1], kv_len [B], block_table [B, pages] int32
        as MLAAttention takes them (decode requests first, num_decode of
        them). Writes next_tokens [B] int32 (greedy unless temperature [B] > 0,
        with top_k [B] int32, top_p [B] and seed [B] int64) and, when given,
        logits: [B, V] fp32 of each request's last row, or [n, V] with
        logits_every_row.

        Speculative decoding: num_drafts [B] int32 (0 or 1) says that the
        request's last row is a draft token to verify; accepted [B] int32
        receives how many were accepted, next_tokens the token after them.
        With mtp=True: draft_tokens [B] int32 (and draft_logits [B, V] fp32)
        receive the MTP module's proposal for the token after next_tokens;
        known_next [B] int32 (-1: none) names the token that follows a
        prefill chunk's last row when the prompt goes on."""
        num_requests = int(q_start.shape[0]) - 1
        self._impl.step(token_ids, q_start, kv_len, block_table, num_requests, int(num_decode),
                        next_tokens, logits, bool(logits_every_row), temperature, top_k, top_p,
                        seed, num_drafts, known_next, accepted, draft_tokens, draft_logits,
                        0 if self._host else stream_handle(stream, token_ids))

    def step_from_host(self, token_ids, q_start, kv_len, block_table, next_tokens, *,
                       num_decode: int = 0, logits=None, logits_every_row: bool = False,
                       temperature=None, top_k=None, top_p=None, seed=None, num_drafts=None,
                       known_next=None, accepted=None, draft_tokens=None, draft_logits=None,
                       stream=None) -> None:
        """step() on contiguous host tensors (numpy or CPU torch) whatever
        the backend, as the serving engine runs it: on a GPU backend they
        are copied into the model's memory and the outputs back once the
        step has run (it returns after the step). With decode_graphs=True,
        decode-only steps run through the batch-size bucket's CUDA graph.
        stream: as step()'s (default: the legacy default stream)."""
        num_requests = int(q_start.shape[0]) - 1
        handle = 0 if self._host else stream_handle(stream, None)
        self._impl.step(token_ids, q_start, kv_len, block_table, num_requests, int(num_decode),
                        next_tokens, logits, bool(logits_every_row), temperature, top_k, top_p,
                        seed, num_drafts, known_next, accepted, draft_tokens, draft_logits, handle,
                        from_host=True)

    def check(self, stream=None) -> None:
        """Raises moelink.InputError for what any layer flagged since the last
        check() (a bad page id or length, a token id outside the vocabulary)."""
        self._impl.check(0 if self._host else stream_handle(stream, None))
