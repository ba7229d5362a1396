"""moelink.MoELayer from Python: the binding on the cpu backend (numpy), and
on a Hopper GPU the whole layer against Hugging Face transformers' own
DeepseekV3MoE, in every overlap mode, through CUDA graphs, and loaded from a
checkpoint that transformers' save_pretrained wrote."""

from __future__ import annotations

import numpy as np
import pytest

import moelink
from fp8_testlib import block_quant as _block_quant, dequant as _dequant
from ranks_testlib import free_port

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


def _boot():
    return moelink.TcpBootstrap(0, 1, "127.0.0.1", free_port(), 30.0)


SMALL = dict(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
             n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
             scoring_func="sigmoid", score_correction_bias=True, norm_topk_prob=True,
             routed_scaling_factor=2.5)


def test_model_config_presets_and_overrides():
    c = moelink.model_config("deepseek-v3")
    assert (c.hidden_size, c.n_routed_experts, c.n_group, c.topk_group) == (7168, 256, 8, 4)
    assert c.scoring_func == "sigmoid" and c.score_correction_bias
    q = moelink.model_config("qwen3-235b-a22b", hidden_size=1024)
    assert q.hidden_size == 1024 and q.scoring_func == "softmax"
    with pytest.raises(ValueError, match="unknown model"):
        moelink.model_config("gpt-5")
    with pytest.raises(ValueError, match="n_group = 3"):
        moelink.model_config("deepseek-v3", n_group=3)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (bf16 numpy)")
def test_cpu_layer_forward_route_and_errors():
    rng = np.random.default_rng()
    layer = moelink.MoELayer("deepseek-v3", max_tokens=8, backend="cpu", bootstrap=_boot(),
                             overlap="dispatch-overlap", **SMALL)
    E, H, I, L = 16, 256, 128, layer.num_local_experts
    assert L == 16
    bf16 = ml_dtypes.bfloat16
    gate = (rng.standard_normal((E, H)) / 16).astype(bf16)
    w13 = (rng.standard_normal((L, 2 * I, H)) * 0.05).astype(np.float32)  # quantized on the way in
    w2 = (rng.standard_normal((L, H, I)) * 0.05).astype(np.float32)
    sw13 = (rng.standard_normal((2 * I, H)) * 0.05).astype(np.float32)
    sw2 = (rng.standard_normal((H, I)) * 0.05).astype(np.float32)
    x = rng.standard_normal((8, H)).astype(bf16)
    out = np.full((8, H), 7.0, dtype=bf16)
    with pytest.raises(ValueError, match="no weights yet"):
        layer.forward(out, x, np.array([6], np.int32))
    layer.set_weights(gate, w13, w2, gate_bias=np.zeros(E, np.float32), shared_w13=sw13,
                      shared_w2=sw2)
    layer.forward(out, x, np.array([6], np.int32))
    layer.check()
    assert np.all(out[6:].astype(np.float32) == 7.0), "rows >= m were written"
    assert np.all(np.isfinite(out[:6].astype(np.float32))) and np.any(out[:6].astype(np.float32) != 7.0)
    idx = np.full((8, 4), -1, np.int32)
    wt = np.zeros((8, 4), np.float32)
    layer.route(idx, wt, x, np.array([8], np.int32))
    assert np.all((idx >= 0) & (idx < E))
    # Group-limited: a token's experts come from at most topk_group = 2 groups of 4.
    assert all(len(set(row // 4)) <= 2 for row in idx)
    np.testing.assert_allclose(wt.sum(axis=1), 2.5, rtol=1e-5)  # normalized, times the scaling
    with pytest.raises(ValueError, match=r"x has shape \[8, 128\]"):
        layer.forward(out, np.zeros((8, 128), bf16), np.array([6], np.int32))


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (bf16 numpy)")
def test_layers_sharing_scratch_give_the_outputs_of_layers_alone():
    """share_with: two layers on one layer's AllToAll, kernels and buffers,
    called alternately, give the same bits as each layer alone; other
    shapes are refused naming the field."""
    rng = np.random.default_rng()
    E, H, I = 16, 256, 128
    bf16 = ml_dtypes.bfloat16

    def weights():
        return dict(gate=(rng.standard_normal((E, H)) / 16).astype(bf16),
                    w13=(rng.standard_normal((E, 2 * I, H)) * 0.05).astype(np.float32),
                    w2=(rng.standard_normal((E, H, I)) * 0.05).astype(np.float32),
                    gate_bias=np.zeros(E, np.float32),
                    shared_w13=(rng.standard_normal((2 * I, H)) * 0.05).astype(np.float32),
                    shared_w2=(rng.standard_normal((H, I)) * 0.05).astype(np.float32))

    def make(share_with=None):
        return moelink.MoELayer("deepseek-v3", max_tokens=8, backend="cpu", bootstrap=_boot(),
                                share_with=share_with, **SMALL)

    wa, wb = weights(), weights()
    first = make()
    second = make(share_with=first)
    alone_a, alone_b = make(), make()
    for layer, w in ((first, wa), (second, wb), (alone_a, wa), (alone_b, wb)):
        w = dict(w)
        layer.set_weights(w.pop("gate"), w.pop("w13"), w.pop("w2"), **w)
    for m in (8, 3, 1):
        x = rng.standard_normal((8, H)).astype(bf16)
        got = []
        for layer in (first, second, alone_a, alone_b):
            out = np.zeros((8, H), bf16)
            layer.forward(out, x, np.array([m], np.int32))
            layer.check()
            got.append(out.view(np.uint16))
        assert np.array_equal(got[0], got[2]) and np.array_equal(got[1], got[3]), f"m = {m}"
        assert not np.array_equal(got[0], got[1]), "the two layers' weights differ"
    with pytest.raises(moelink.InvalidArgument, match="share_with has max_tokens = 8, this layer 4"):
        moelink.MoELayer("deepseek-v3", max_tokens=4, backend="cpu", bootstrap=_boot(), share_with=first,
                         **SMALL)


def test_two_micro_batches_in_stages_give_forwards_bits():
    """stage_begin / stage_middle / stage_end of two micro-batches,
    interleaved, give the bits forward() gives each alone; a call out of
    order is refused naming what was expected, and the layer runs on."""
    rng = np.random.default_rng()
    E, H, I = 16, 256, 128
    bf16 = ml_dtypes.bfloat16
    layer = moelink.MoELayer("deepseek-v3", max_tokens=8, backend="cpu", bootstrap=_boot(),
                             overlap="micro-batch", **SMALL)
    layer.set_weights((rng.standard_normal((E, H)) / 16).astype(bf16),
                      (rng.standard_normal((E, 2 * I, H)) * 0.05).astype(np.float32),
                      (rng.standard_normal((E, H, I)) * 0.05).astype(np.float32),
                      gate_bias=np.zeros(E, np.float32),
                      shared_w13=(rng.standard_normal((2 * I, H)) * 0.05).astype(np.float32),
                      shared_w2=(rng.standard_normal((H, I)) * 0.05).astype(np.float32))
    for m0, m1 in ((4, 4), (3, 1), (1, 0)):
        xs = [rng.standard_normal((4, H)).astype(bf16) for _ in range(2)]
        ms = [np.array([m0], np.int32), np.array([m1], np.int32)]
        staged = [np.zeros((4, H), bf16) for _ in range(2)]
        layer.stage_begin(0, staged[0], xs[0], ms[0])
        layer.stage_begin(1, staged[1], xs[1], ms[1])
        layer.stage_middle(1)
        layer.stage_middle(0)
        layer.stage_end(0)
        layer.stage_end(1)
        layer.check()
        for p in (0, 1):
            alone = np.zeros((4, H), bf16)
            layer.forward(alone, xs[p], ms[p])
            layer.check()
            assert np.array_equal(staged[p].view(np.uint16), alone.view(np.uint16)), (m0, m1, p)
    with pytest.raises(moelink.InvalidArgument, match="micro-batch 0 was not begun"):
        layer.stage_end(0)
    out = np.zeros((4, H), bf16)
    layer.forward(out, xs[0], ms[0])
    layer.check()


# ------------------------------------------------------------ CUDA: Hugging Face

def _torch_hopper():
    try:
        import torch
    except ImportError:
        return None
    if not (moelink.with_cuda and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9):
        return None
    return torch


def _hf():
    try:
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    except ImportError:
        return None
    return DeepseekV3Config, DeepseekV3MoE


def _hf_config(Config):
    return Config(hidden_size=512, moe_intermediate_size=256, n_routed_experts=16,
                  n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, hidden_act="silu",
                  num_hidden_layers=1, first_k_dense_replace=0, intermediate_size=1024,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                  kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                  vocab_size=512)


def _hf_moe_with_fp8_weights(torch, Config, MoE, seed):
    """A DeepseekV3MoE whose expert weights are exactly fp8 block-quantized
    values, and those fp8 weights with their scales."""
    torch.manual_seed(seed)
    cfg = _hf_config(Config)
    moe = MoE(cfg).cuda().float()
    E, H, I = 16, 512, 256
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, H, device="cuda") / H ** 0.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(E, device="cuda") * 0.05)
        q13, s13 = _block_quant(torch, torch.randn(E, 2 * I, H, device="cuda") * 0.05)
        q2, s2 = _block_quant(torch, torch.randn(E, H, I, device="cuda") * 0.05)
        moe.experts.gate_up_proj.copy_(_dequant(torch, q13, s13))
        moe.experts.down_proj.copy_(_dequant(torch, q2, s2))
        sq13, ss13 = _block_quant(torch, torch.randn(2 * I, H, device="cuda") * 0.05)
        sq2, ss2 = _block_quant(torch, torch.randn(H, I, device="cuda") * 0.05)
        sd13 = _dequant(torch, sq13, ss13)
        moe.shared_experts.gate_proj.weight.copy_(sd13[:I])
        moe.shared_experts.up_proj.weight.copy_(sd13[I:])
        moe.shared_experts.down_proj.weight.copy_(_dequant(torch, sq2, ss2))
    weights = dict(gate=moe.gate.weight.detach().contiguous(),
                   gate_bias=moe.gate.e_score_correction_bias.detach().float().contiguous(),
                   w13=q13, w13_scale=s13, w2=q2, w2_scale=s2, shared_w13=sq13,
                   shared_w13_scale=ss13, shared_w2=sq2, shared_w2_scale=ss2)
    return moe, weights


def _compare_with_hf(torch, moe, layer, x, m):
    """Relative L2 error over the tokens whose experts agree, and how many
    disagree (ties of the fp32 router)."""
    with torch.no_grad():
        _, _, hf_idx = moe.gate(x[:m].float())
        ref = moe(x[:m].float().unsqueeze(0)).squeeze(0)
    idx = torch.full((x.shape[0], 4), -1, dtype=torch.int32, device="cuda")
    wt = torch.zeros((x.shape[0], 4), dtype=torch.float32, device="cuda")
    bm = torch.tensor([m], dtype=torch.int32, device="cuda")
    layer.route(idx, wt, x, bm)
    out = torch.full_like(x, 7.0)
    layer.forward(out, x, bm, num_tokens=x.shape[0])
    torch.cuda.synchronize()
    layer.check()
    assert torch.all(out[m:] == 7.0), "rows >= m were written"
    same = (idx[:m].sort(dim=1).values == hf_idx.int().sort(dim=1).values).all(dim=1)
    err = (out[:m][same].float() - ref[same]).norm() / ref[same].norm()
    return err.item(), int((~same).sum())


# moelink quantizes the layer's input and SiLU(gate) * up to fp8 e4m3 (1x128
# groups) before each GEMM; transformers' module keeps both in full precision.
# e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2^-4,
# about 2.6% RMS per quantization; two of them give about 3.7% at the output
# (plus bf16 roundings, 0.2%). The bound leaves 1.6x room.
HF_BOUND = 0.06


@pytest.mark.parametrize("overlap", ["none", "dispatch-overlap", "micro-batch"])
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_layer_matches_hf_deepseek_v3_moe(overlap, graphs):
    torch, hf = _torch_hopper(), _hf()
    if torch is None or hf is None:
        pytest.skip("needs torch, transformers and a Hopper GPU (runs on the H200 device machine)")
    Config, MoE = hf
    moe, w = _hf_moe_with_fp8_weights(torch, Config, MoE, seed=int(np.random.default_rng().integers(1 << 30)))
    layer = moelink.MoELayer(_hf_config(Config).to_dict(), max_tokens=64, backend="nvlink",
                             bootstrap=_boot(), overlap=overlap, cuda_graphs=graphs)
    layer.set_weights(w["gate"], w["w13"], w["w2"], gate_bias=w["gate_bias"],
                      w13_scale=w["w13_scale"], w2_scale=w["w2_scale"], shared_w13=w["shared_w13"],
                      shared_w13_scale=w["shared_w13_scale"], shared_w2=w["shared_w2"],
                      shared_w2_scale=w["shared_w2_scale"])
    for m in (64, 37, 1):  # new tokens and m each call (graph replays)
        x = torch.randn(64, 512, device="cuda").to(torch.bfloat16)
        err, differ = _compare_with_hf(torch, moe, layer, x, m)
        assert differ <= max(1, m // 20), f"{differ} of {m} tokens routed differently from HF"
        assert err < HF_BOUND, f"m={m}: relative L2 error {err:.4f} against DeepseekV3MoE"


def test_cuda_layer_loads_save_pretrained_checkpoint(tmp_path):
    torch, hf = _torch_hopper(), _hf()
    if torch is None or hf is None:
        pytest.skip("needs torch, transformers and a Hopper GPU (runs on the H200 device machine)")
    Config, MoE = hf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
    cfg = _hf_config(Config)
    model = DeepseekV3ForCausalLM(cfg).cuda()
    moe, _ = _hf_moe_with_fp8_weights(torch, Config, MoE, seed=1234)
    model.model.layers[0].mlp.load_state_dict(moe.state_dict())
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    layer = moelink.MoELayer(cfg.to_dict(), max_tokens=32, backend="nvlink", bootstrap=_boot())
    layer.load_checkpoint(str(tmp_path), 0)
    moe_bf16 = model.model.layers[0].mlp.float()  # what the checkpoint holds
    x = torch.randn(32, 512, device="cuda").to(torch.bfloat16)
    err, differ = _compare_with_hf(torch, moe_bf16, layer, x, 32)
    assert differ <= 2, f"{differ} of 32 tokens routed differently from HF"
    assert err < HF_BOUND, f"relative L2 error {err:.4f} against the saved DeepseekV3MoE"
