"""The Python-facing Experts: resolves the CUDA device and stream, then calls
the C++ binding (which releases the GIL while it runs)."""

from __future__ import annotations

from typing import Optional

from . import _C
from ._all_to_all import stream_handle, sync_cuda_device

_DEVICES = ("cuda", "cpu")


class Experts:
    """The expert computation between dispatch and combine, in DeepSeek-V3's
    fp8 format (fp8 e4m3 weights with one fp32 scale per 128 x 128 block,
    activations quantized per 1 x 128 group on the fly).

    Experts(num_experts, max_rows, hidden_dim, intermediate_dim, *,
            device="cuda", expected_rows=0, debug=None)

    num_experts (L) and max_rows (C) are the AllToAll's num_local_experts and
    expert_capacity; hidden_dim (H) and intermediate_dim (I) multiples of
    128. device "cuda" (the current CUDA device, a Hopper GPU) or "cpu"
    (host tensors, plain loops). expected_rows picks the GPU's GEMM tiles
    (<= 64: decode tiles; 0 = max_rows). Row counts stay on the device: every
    call can be captured in a CUDA graph. fp8 tensors may be torch.float8_e4m3fn
    or uint8. See docs/experts.md for shapes and layouts."""

    def __init__(self, num_experts: int, max_rows: int, hidden_dim: int, intermediate_dim: int,
                 *, device: str = "cuda", expected_rows: int = 0, debug: Optional[bool] = None):
        if device not in _DEVICES:
            raise ValueError(f"moelink: Experts: device = {device!r} must be 'cuda' or 'cpu'")
        if device == "cuda":
            sync_cuda_device()
        self._device = device
        self._impl = _C.Experts(int(num_experts), int(max_rows), int(hidden_dim),
                                int(intermediate_dim), device, int(expected_rows),
                                -1 if debug is None else int(bool(debug)))

    def _stream(self, stream, like) -> int:
        return 0 if self._device == "cpu" else stream_handle(stream, like)

    def forward(self, expert_y, expert_num_tokens, expert_x, expert_x_scale, w13, w13_scale, w2,
                w2_scale, stream=None, expected_rows: int = 0) -> None:
        """expert_y [L, C, H] bf16 = w2 . q(silu(w13[:, :I] . x) * (w13[:, I:] . x)) for
        rows r < expert_num_tokens[l]. expert_x [L, C, H] fp8, expert_x_scale
        [L, C, H/128] fp32 (packed rows), w13 [L, 2I, H] fp8 (gate rows then up
        rows), w13_scale [L, 2I/128, H/128], w2 [L, H, I], w2_scale [L, H/128, I/128].
        expected_rows: the rows an expert is expected to hold in this call,
        which picks the GPU GEMMs' tiles (0: the config's; larger counts as it)."""
        self._impl.forward(expert_y, expert_num_tokens, expert_x, expert_x_scale, w13, w13_scale,
                           w2, w2_scale, self._stream(stream, expert_x), int(expected_rows))

    def grouped_gemm(self, y, count, x, x_scale, w, w_scale, stream=None, expected_rows: int = 0) -> None:
        """y [L, C, N] bf16 = x [L, C, K] fp8 . w [L, N, K]^T with x_scale [L, C, K/128]
        and w_scale [L, N/128, K/128], for rows r < count[l]; expected_rows as
        forward()'s."""
        self._impl.grouped_gemm(y, count, x, x_scale, w, w_scale, self._stream(stream, x),
                                int(expected_rows))

    def silu_mul_quant(self, out_q, out_scale, gate_up, count, stream=None) -> None:
        """out_q [L, C, I] fp8 and out_scale [L, C, I/128] fp32 (any strides) from
        silu(gate_up[..., :I]) * gate_up[..., I:], bf16, for rows r < count[l]."""
        self._impl.silu_mul_quant(out_q, out_scale, gate_up, count, self._stream(stream, gate_up))

    def quantize(self, out_q, out_scale, x, bound_m=None, stream=None) -> None:
        """1x128 quantization of x [M, K] bf16 into out_q [M, K] fp8 and out_scale
        [M, K/128] fp32, rows r < bound_m[0] (all M when bound_m is None)."""
        self._impl.quantize(out_q, out_scale, x, bound_m, self._stream(stream, x))

    def gemm(self, y, x, x_scale, w, w_scale, bound_m=None, stream=None) -> None:
        """The dense block-scaled GEMM: y [M, N] bf16 = x [M, K] . w [N, K]^T for
        rows r < bound_m[0] (all M when None)."""
        self._impl.gemm(y, x, x_scale, w, w_scale, bound_m, self._stream(stream, x))

    def check(self, stream=None) -> None:
        """Waits for the issued work; raises moelink.InputError for a row count
        the kernels had to clamp."""
        self._impl.check(0 if self._device == "cpu" else stream_handle(stream, None))

    @property
    def workspace_bytes(self) -> int:
        """Bytes of forward()'s workspace ([L, C, 2I] bf16 + [L, C, I] fp8 + scales)."""
        return self._impl.workspace_bytes

    @property
    def device(self) -> str:
        return self._device

    def __repr__(self) -> str:
        return f"moelink.Experts({self._impl.config})"
