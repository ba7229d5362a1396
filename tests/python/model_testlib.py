"""A small DeepSeek-V3-shaped model for the model and engine tests: its
config and a random checkpoint written with numpy alone (no torch), in
transformers' tensor names."""

from __future__ import annotations

import json
import socket

import numpy as np

SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
             num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, max_position_embeddings=2048, rope_theta=10000.0,
             rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
             tie_word_embeddings=False, rms_norm_eps=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_checkpoint(directory, fields, seed):
    """A random DeepSeek-V3-layout checkpoint (bf16, transformers' names)
    written with numpy alone (no torch), and its config.json."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    D, V, I, Im = (fields[k] for k in ("hidden_size", "vocab_size", "intermediate_size",
                                       "moe_intermediate_size"))
    H, Rq, R, E = (fields[k] for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                       "n_routed_experts"))
    t = {}

    def w(name, *shape, scale=None):
        fan = shape[-1]
        t[name] = (rng.standard_normal(shape) / (fan ** 0.5 if scale is None else 1 / scale))

    w("model.embed_tokens.weight", V, D, scale=1.0)
    w("lm_head.weight", V, D)
    t["model.norm.weight"] = rng.uniform(0.5, 1.5, D)
    for l in range(fields["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = rng.uniform(0.5, 1.5, D)
        t[p + "post_attention_layernorm.weight"] = rng.uniform(0.5, 1.5, D)
        a = p + "self_attn."
        w(a + "q_a_proj.weight", Rq, D)
        t[a + "q_a_layernorm.weight"] = rng.uniform(0.5, 1.5, Rq)
        w(a + "kv_a_proj_with_mqa.weight", R + 64, D)
        t[a + "kv_a_layernorm.weight"] = rng.uniform(0.5, 1.5, R)
        w(a + "q_b_proj.weight", H * 192, Rq)
        w(a + "kv_b_proj.weight", H * 256, R)
        w(a + "o_proj.weight", D, H * 128)
        m = p + "mlp."
        if l < fields["first_k_dense_replace"]:
            w(m + "gate_proj.weight", I, D)
            w(m + "up_proj.weight", I, D)
            w(m + "down_proj.weight", D, I)
        else:
            w(m + "gate.weight", E, D)
            t[m + "gate.e_score_correction_bias"] = rng.standard_normal(E) * 0.05
            for e in range(E):
                w(m + f"experts.{e}.gate_proj.weight", Im, D)
                w(m + f"experts.{e}.up_proj.weight", Im, D)
                w(m + f"experts.{e}.down_proj.weight", D, Im)
            Is = Im * fields["n_shared_experts"]
            w(m + "shared_experts.gate_proj.weight", Is, D)
            w(m + "shared_experts.up_proj.weight", Is, D)
            w(m + "shared_experts.down_proj.weight", D, Is)
    # safetensors: an 8-byte header length, a JSON header, the raw bytes.
    header, blobs, offset = {}, [], 0
    for name, v in t.items():
        b = np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(np.shape(v)), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(f"{directory}/model.safetensors", "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    with open(f"{directory}/config.json", "w") as f:
        json.dump(dict(fields, model_type="deepseek_v3"), f)
