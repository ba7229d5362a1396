"""DeepSeek-V3's fp8 weight format for the tests that hand weights to both
moelink and transformers: 128 x 128 blocks scaled by amax / 448."""

from __future__ import annotations


def block_quant(torch, w):
    """[..., n, k] fp32 (n a multiple of 128 after padding) -> fp8 [..., n, k]
    and [..., ceil(n/128), k/128] scales (amax / 448); rows past n in the last
    block count as zeros."""
    n, k = w.shape[-2:]
    pad = (-n) % 128
    wp = torch.nn.functional.pad(w, (0, 0, 0, pad)) if pad else w
    b = wp.unflatten(-2, ((n + pad) // 128, 128)).unflatten(-1, (k // 128, 128))
    s = b.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / 448.0
    q = (wp / s.repeat_interleave(128, -2).repeat_interleave(128, -1)).to(torch.float8_e4m3fn)
    return q[..., :n, :].contiguous(), s.float().contiguous()


def dequant(torch, q, s):
    """The fp32 values fp8 `q` with block scales `s` stand for."""
    n = q.shape[-2]
    full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
    return q.float() * full[..., :n, :]
