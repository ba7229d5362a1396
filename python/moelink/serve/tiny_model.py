"""A tiny random DeepSeek-V3-shaped model directory that moelink writes
itself (nothing is downloaded): config.json, a bf16 safetensors checkpoint
in transformers' tensor names (numpy alone, no torch), a word-level
tokenizer.json and a chat template. For trying moelink-serve and for the
tests.

    python -m moelink.serve.tiny_model DIR [--layers 2] [--seed 0]
    python -m moelink.serve --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

# Two heads' worth of everything that makes a DeepSeek-V3 layer: MLA with
# the real head dims, one dense layer, then MoE layers of 16 experts in 4
# groups (top-4 in 2 groups) with a shared expert.
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
             num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, max_position_embeddings=2048, rope_theta=10000.0,
             rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
             tie_word_embeddings=False, rms_norm_eps=1e-6)



SPECIAL = ["<unk>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(vocab_size: int):
    """The tokenizer's vocabulary: the special tokens, then w0, w1, ..."""
    return SPECIAL + [f"w{i}" for i in range(vocab_size - len(SPECIAL))]


def write_checkpoint(directory, fields, seed, echo=False):
    """A random DeepSeek-V3-layout checkpoint (bf16, transformers' names)
    written with numpy alone (no torch), and its config.json. With
    num_nextn_predict_layers = 1, also the MTP module (layer
    num_hidden_layers: enorm, hnorm, eh_proj, a MoE decoder layer,
    shared_head) in DeepSeek-V3's names. echo=True writes a model that
    mostly repeats its input token, and an MTP module that drafts the token
    it is given: its drafts are then often right (speculative decoding's
    tests): both heads are the embedding table, every layer's output
    projections are scaled by 0.1, eh_proj passes the embedding half."""
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
    L = fields["num_hidden_layers"]
    mtp = fields.get("num_nextn_predict_layers", 0)
    if mtp not in (0, 1):
        raise ValueError(f"num_nextn_predict_layers = {mtp}: the tiny model writes 0 or 1 MTP modules")
    for l in range(L + mtp):
        p = f"model.layers.{l}."
        if l == L:  # the MTP module's own parts, then its decoder layer
            t[p + "enorm.weight"] = rng.uniform(0.5, 1.5, D)
            t[p + "hnorm.weight"] = rng.uniform(0.5, 1.5, D)
            w(p + "eh_proj.weight", D, 2 * D)
            t[p + "shared_head.norm.weight"] = rng.uniform(0.5, 1.5, D)
            w(p + "shared_head.head.weight", V, D)
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
    if echo:
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
        for name in t:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t[name] = t[name] * 0.1
            elif name.endswith("shared_head.head.weight"):
                t[name] = t["model.embed_tokens.weight"]
            elif name.endswith("eh_proj.weight"):
                t[name] = np.concatenate([np.eye(D), np.zeros((D, D))], axis=1)
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


def write_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer.json (whitespace-separated words w0, w1, ...)
    and a tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words(vocab_size))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(f"{directory}/tokenizer.json")
    with open(f"{directory}/tokenizer_config.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


def write_tiny_model(directory, *, layers: int = 2, seed: int = 0, echo: bool = False, **overrides) -> dict:
    """Writes the whole directory; returns the config's fields."""
    fields = dict(TINY, rope_scaling=None, num_hidden_layers=layers, eos_token_id=1, **overrides)
    write_checkpoint(directory, fields, seed, echo)
    write_tokenizer(directory, fields["vocab_size"])
    return fields


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelink.serve.tiny_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (the first is dense)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="also an MTP module (speculative decoding)")
    a = p.parse_args(argv)
    import os
    os.makedirs(a.directory, exist_ok=True)
    write_tiny_model(a.directory, layers=a.layers, seed=a.seed, num_nextn_predict_layers=int(a.mtp))
    print(f"moelink: a tiny random model in {a.directory}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
