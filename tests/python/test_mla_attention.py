"""moelink.MLAAttention from Python: the binding on the CPU path (numpy), and
against Hugging Face transformers' own DeepseekV3Attention with random
weights (fp8-quantized, dequantized for the HF module): prefill in chunks,
then decodes of one and two query tokens, on the CPU path and, on a Hopper
GPU, the CUDA path."""

from __future__ import annotations

import json

import numpy as np
import pytest

import moelink
from fp8_testlib import block_quant, dequant

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

SMALL = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
             rms_norm_eps=1e-6, max_position_embeddings=2048,
             rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def test_config_from_hf_json_and_presets():
    c = moelink.mla_config(dict(SMALL))
    assert (c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.cache_row) == (256, 4, 128, 192)
    assert c.rope_scaling.type == "yarn" and c.rope_scaling.factor == 8.0
    ds = moelink.mla_config("deepseek-v3")
    assert ds.cache_bytes_per_token(61) == 70272  # the seed's bytes per token
    mscale = 0.1 * np.log(40.0) + 1.0
    assert abs(ds.softmax_scale() - mscale * mscale / 192 ** 0.5) < 1e-12
    with pytest.raises(ValueError, match="kv_lora_rank = 500"):
        moelink.mla_config(dict(SMALL, kv_lora_rank=500))
    with pytest.raises(TypeError, match="unknown config field"):
        moelink.mla_config("deepseek-v3", heads=4)


def test_decode_kernel_is_checked():
    kw = dict(max_tokens=4, max_requests=1, max_pages_per_request=1)
    with pytest.raises(ValueError, match="decode_kernel = 'fast' must be 'auto', 'flashinfer', 'flashmla' or"):
        moelink.MLAAttention(dict(SMALL), device="cpu", decode_kernel="fast", **kw)
    torch = _torch()
    if moelink.with_cuda and torch is not None and torch.cuda.is_available():
        # SMALL's latent (128) is neither FlashInfer's instantiation (512) nor FlashMLA's.
        for kernel in ("flashinfer", "flashmla"):
            with pytest.raises(ValueError, match=f"decode_kernel = {kernel} .*"):
                moelink.MLAAttention(dict(SMALL), device="cuda", decode_kernel=kernel, **kw)
        moelink.MLAAttention(dict(SMALL), device="cuda", decode_kernel="moelink", **kw)


def test_prefill_kernel_is_checked():
    kw = dict(max_tokens=4, max_requests=1, max_pages_per_request=1)
    with pytest.raises(ValueError, match="prefill_kernel = 'fa3'"):
        moelink.MLAAttention(dict(SMALL), device="cpu", prefill_kernel="fa3", **kw)
    moelink.MLAAttention(dict(SMALL), device="cpu", prefill_kernel="moelink", **kw)
    torch = _torch()
    if moelink.with_cuda and torch is not None and torch.cuda.is_available():
        # FlashInfer's prefill instantiation is v_head_dim 128 (or the build lacks it).
        with pytest.raises(ValueError, match="prefill_kernel = flashinfer"):
            moelink.MLAAttention(dict(SMALL, v_head_dim=256), device="cuda", prefill_kernel="flashinfer", **kw)


def test_head_gemm_is_checked():
    kw = dict(max_tokens=4, max_requests=1, max_pages_per_request=1)
    with pytest.raises(ValueError, match="head_gemm = 'fp16'"):
        moelink.MLAAttention(dict(SMALL), device="cpu", head_gemm="fp16", **kw)
    for g in ("fp8", "bf16"):
        moelink.MLAAttention(dict(SMALL), device="cpu", head_gemm=g, **kw)


def test_share_with_takes_the_same_shapes_only():
    """share_with: a second layer on the first's scratch is made (its own
    weights to come); another max_tokens or head count is refused, naming it."""
    kw = dict(max_tokens=4, max_requests=1, max_pages_per_request=1)
    first = moelink.MLAAttention(dict(SMALL), device="cpu", **kw)
    second = moelink.MLAAttention(dict(SMALL), device="cpu", share_with=first, **kw)
    assert second.local_heads == first.local_heads
    with pytest.raises(ValueError, match="share_with has max_tokens = 4, this layer 8"):
        moelink.MLAAttention(dict(SMALL), device="cpu", share_with=first, **dict(kw, max_tokens=8))
    with pytest.raises(ValueError, match="share_with has num_attention_heads"):
        moelink.MLAAttention(dict(SMALL, num_attention_heads=SMALL["num_attention_heads"] * 2), device="cpu",
                             share_with=first, **kw)


def _numpy_weights(rng, c):
    """fp8 (uint8 codes) weights with their block scales, as a checkpoint holds them."""
    def proj(n, k):
        q = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0  # no NaN codes
        s = (rng.uniform(0.5, 1.5, size=((n + 127) // 128, k // 128)) * 1e-3).astype(np.float32)
        return q, s
    H, D = c["num_attention_heads"], c["hidden_size"]
    w = {}
    for name, (n, k) in dict(q_a_proj=(128, D), kv_a_proj_with_mqa=(192, D), q_b_proj=(H * 192, 128),
                             kv_b_proj=(H * 256, 128), o_proj=(D, H * 128)).items():
        w[name], w[name + "_scale"] = proj(n, k)
    w["q_a_layernorm"] = np.ones(128, np.float32)
    w["kv_a_layernorm"] = np.ones(128, np.float32)
    return w


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (bf16 numpy)")
def test_cpu_binding_runs_a_step_and_reports_bad_values():
    rng = np.random.default_rng()
    attn = moelink.MLAAttention(dict(SMALL), device="cpu", max_tokens=16, max_requests=2,
                                max_pages_per_request=4, page_size=16)
    assert attn.local_heads == 4
    w = _numpy_weights(rng, SMALL)
    with pytest.raises(ValueError, match="unknown weight 'q_proj'"):
        attn.set_weights(q_proj=w["q_a_proj"])
    attn.set_weights(**w)
    bf16 = ml_dtypes.bfloat16
    x = rng.standard_normal((5, 256)).astype(bf16)
    out = np.full((5, 256), 7.0, dtype=bf16)
    cache = np.zeros((4, 16, 192), dtype=bf16)
    q_start = np.array([0, 3, 4], np.int32)
    kv_len = np.array([3, 1], np.int32)
    table = np.array([[2, 0], [1, 3]], np.int32)
    attn.forward(out, x, cache, q_start, kv_len, table, num_decode=0)
    attn.check()
    assert np.all(np.isfinite(out[:4].astype(np.float32))) and np.all(out[4] == 7.0)
    assert np.any(cache[2, :3] != 0) and np.all(cache[0] == 0) and np.any(cache[1, 0] != 0)
    # A page id outside the cache: skipped (zeros) and reported once.
    bad = np.array([[9, 0], [1, 3]], np.int32)
    attn.forward(out, x, cache, q_start, kv_len, bad, num_decode=0)
    with pytest.raises(moelink.InputError, match=r"block_table\[0\]\[0\] = 9"):
        attn.check()
    attn.check()
    assert np.all(out[:3].astype(np.float32) == 0)
    with pytest.raises(ValueError, match="x"):
        attn.forward(out, x.astype(np.float32), cache, q_start, kv_len, table)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _hf_attention():
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    except ImportError:
        return None
    return DeepseekV3Config, DeepseekV3Attention, DeepseekV3RotaryEmbedding


def _hf_setup(torch, hf, fields, seed, device):
    """An HF DeepseekV3Attention (fp32, eager) whose projections are exactly
    fp8 block-quantized values, and those fp8 weights with their scales."""
    Config, Attention, Rotary = hf
    cfg = Config(**fields, num_key_value_heads=fields["num_attention_heads"], vocab_size=256,
                 num_hidden_layers=1, intermediate_size=512, moe_intermediate_size=128,
                 attn_implementation="eager")
    torch.manual_seed(seed)
    attn = Attention(cfg, layer_idx=0).to(device).float()
    rotary = Rotary(cfg).to(device)
    weights = {}
    with torch.no_grad():
        for name in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"):
            lin = getattr(attn, name)
            # Variance 1 / fan-in (scores of a few units, as trained weights
            # give): a wider draw makes the softmax one-hot and every fp8
            # rounding of q or k decides which key wins.
            q, s = block_quant(torch, torch.randn_like(lin.weight) / lin.weight.shape[1] ** 0.5)
            lin.weight.copy_(dequant(torch, q, s))
            weights[name], weights[name + "_scale"] = q, s
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(attn, name)
            norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
            weights[name] = norm.weight.detach().float().contiguous()
    return cfg, attn, rotary, weights


def _hf_outputs(torch, attn, rotary, x):
    """HF's attention over the whole sequence x [L, D] (causal), fp32."""
    L = x.shape[0]
    h = x.float().unsqueeze(0)
    pos = torch.arange(L, device=x.device).unsqueeze(0)
    mask = torch.full((L, L), float("-inf"), device=x.device).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(h, position_embeddings=rotary(h, pos), attention_mask=mask)
    return out.squeeze(0)


# moelink quantizes every projection's input to fp8 e4m3 per 1x128 group
# (x, q_a's normed output, the attention output; decode also q_nope before
# W_UK and the latent output before W_UV, prefill the latent before
# kv_b_proj) and stores bf16 tensors; transformers' module here runs in fp32
# on the same (dequantized) weights. e4m3 keeps 3 mantissa bits, about 2.6 %
# RMS per quantization, and four of them stand between any input and the
# output (about 5 %), more where the softmax is peaked. Measured 6.3-7.0 %
# (worst row 11 %) on the small model and at DeepSeek-V3's widths. A wrong
# head, position or mask is off by tens of percent.
HF_BOUND = 0.10

# DeepSeek-V3's attention widths (its config.json's fields).
FULL = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
            rms_norm_eps=1e-6, max_position_embeddings=163840,
            rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def _run_moelink(torch, attn, x, device, page, steps):
    """Runs `steps` [(query tokens, decode?)] over x [L, D] for one request;
    returns the out rows of every step, in order."""
    c = attn.config
    pages = (x.shape[0] + page - 1) // page
    perm = torch.randperm(pages + 3, device=device).to(torch.int32)  # pages in random order
    cache = torch.full((pages + 3, page, c.cache_row), float("nan"), dtype=torch.bfloat16,
                       device=device)  # unused pages are NaN
    table = perm[:pages].unsqueeze(0).contiguous()
    rows, done = [], 0
    for q_len, decode in steps:
        xs = x[done:done + q_len].contiguous()
        out = torch.full_like(xs, 7.0)
        q_start = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        kv_len = torch.tensor([done + q_len], dtype=torch.int32, device=device)
        attn.forward(out, xs, cache, q_start, kv_len, table, num_decode=1 if decode else 0)
        attn.check()
        rows.append(out.float())
        done += q_len
    return torch.cat(rows)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("width", ["small", "full"])
def test_matches_hf_deepseek_v3_attention(device, width):
    torch, hf = _torch(), _hf_attention()
    if torch is None or hf is None:
        pytest.skip("needs torch and transformers (runs on the H200 device machine; on CI where "
                    "they are installed)")
    if device == "cuda" and not (moelink.with_cuda and torch.cuda.is_available()):
        pytest.skip("needs a Hopper GPU (runs on the H200 device machine)")
    fields = SMALL if width == "small" else FULL
    seed = int(np.random.default_rng().integers(1 << 30))
    cfg, hf_attn, rotary, w = _hf_setup(torch, hf, fields, seed, device)
    attn = moelink.MLAAttention(cfg.to_dict(), device=device, max_tokens=64, max_requests=4,
                                max_pages_per_request=8, page_size=16)
    attn.set_weights(**{k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                        for k, v in w.items()})
    # A prefill in two chunks, then decodes of two and one tokens (the full
    # width on the CPU path: fewer tokens, its loops take seconds a token).
    steps = [(33, False), (24, False), (2, True), (1, True)] if width == "small" else \
        [(7, False), (4, False), (2, True), (1, True)]
    L = sum(q for q, _ in steps)
    x = torch.randn(L, fields["hidden_size"], device=device).to(torch.bfloat16)
    ref = _hf_outputs(torch, hf_attn, rotary, x)
    got = _run_moelink(torch, attn, x, device, 16, steps)
    err = ((got - ref).norm(dim=1) / ref.norm(dim=1))
    total = ((got - ref).norm() / ref.norm()).item()
    print(f"seed {seed}: relative L2 {total:.3e}, worst row {err.max().item():.3e}")
    assert torch.isfinite(got).all(), "NaN from the unused pages leaked"
    assert total < HF_BOUND, f"seed {seed}: relative L2 error {total:.3e} against HF"
    assert err.max().item() < 2 * HF_BOUND, f"seed {seed}: worst row {err.max().item():.3e}"


def test_loads_a_save_pretrained_checkpoint(tmp_path):
    torch, hf = _torch(), _hf_attention()
    if torch is None or hf is None:
        pytest.skip("needs torch and transformers (runs on the H200 device machine; on CI where "
                    "they are installed)")
    from safetensors.torch import save_file
    cfg, hf_attn, rotary, w = _hf_setup(torch, hf, SMALL, 7, "cpu")
    # A bf16 checkpoint with HF's names, as save_pretrained writes them.
    tensors = {f"model.layers.3.self_attn.{k}": v.detach().to(torch.bfloat16).contiguous()
               for k, v in hf_attn.state_dict().items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    attn = moelink.MLAAttention(str(tmp_path / "config.json"), device="cpu", max_tokens=32,
                                max_requests=1, max_pages_per_request=2, page_size=16)
    attn.load_checkpoint(str(tmp_path), 3)
    x = torch.randn(20, SMALL["hidden_size"]).to(torch.bfloat16)
    got = _run_moelink(torch, attn, x, "cpu", 16, [(20, False)])
    ref = _hf_outputs(torch, hf_attn, rotary, x)
    total = ((got - ref).norm() / ref.norm()).item()
    assert total < HF_BOUND, f"relative L2 error {total:.3e} against HF after load_checkpoint"
    with pytest.raises(ValueError, match="model.layers.4.self_attn.q_a_proj.weight"):
        attn.load_checkpoint(str(tmp_path), 4)
