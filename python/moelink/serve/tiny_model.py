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


def checkpoint_tensors(fields):
    """Every tensor of a DeepSeek-V3-layout checkpoint of `fields`, in
    transformers' names, layer by layer: yields (layer, name, shape, kind),
    layer -1 for the embedding, final norm and lm_head, and kind one of
    "embed" (N(0, 1)), "norm" (around 1), "linear" (a projection, N(0,
    1/fan-in); fp8 in DeepSeek-V3's own checkpoints), "router" (the MoE
    gates and the output heads, lm_head and the MTP module's
    shared_head.head: N(0, 1/fan-in), never fp8) or "bias" (the router's
    e_score_correction_bias). With num_nextn_predict_layers = 1, also the
    MTP module (layer num_hidden_layers: enorm, hnorm, eh_proj, a MoE
    decoder layer, shared_head)."""
    D, V, I, Im = (fields[k] for k in ("hidden_size", "vocab_size", "intermediate_size",
                                       "moe_intermediate_size"))
    H, Rq, R, E = (fields[k] for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                       "n_routed_experts"))
    Dn, Dr, Dv = (fields.get(k, d) for k, d in (("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                                                 ("v_head_dim", 128)))
    yield -1, "model.embed_tokens.weight", (V, D), "embed"
    yield -1, "lm_head.weight", (V, D), "router"
    yield -1, "model.norm.weight", (D,), "norm"
    L = fields["num_hidden_layers"]
    mtp = fields.get("num_nextn_predict_layers", 0)
    if mtp not in (0, 1):
        raise ValueError(f"num_nextn_predict_layers = {mtp}: moelink writes 0 or 1 MTP modules")
    for l in range(L + mtp):
        p = f"model.layers.{l}."
        if l == L:  # the MTP module's own parts, then its decoder layer
            yield l, p + "enorm.weight", (D,), "norm"
            yield l, p + "hnorm.weight", (D,), "norm"
            yield l, p + "eh_proj.weight", (D, 2 * D), "linear"
            yield l, p + "shared_head.norm.weight", (D,), "norm"
            yield l, p + "shared_head.head.weight", (V, D), "router"
        yield l, p + "input_layernorm.weight", (D,), "norm"
        yield l, p + "post_attention_layernorm.weight", (D,), "norm"
        a = p + "self_attn."
        yield l, a + "q_a_proj.weight", (Rq, D), "linear"
        yield l, a + "q_a_layernorm.weight", (Rq,), "norm"
        yield l, a + "kv_a_proj_with_mqa.weight", (R + Dr, D), "linear"
        yield l, a + "kv_a_layernorm.weight", (R,), "norm"
        yield l, a + "q_b_proj.weight", (H * (Dn + Dr), Rq), "linear"
        yield l, a + "kv_b_proj.weight", (H * (Dn + Dv), R), "linear"
        yield l, a + "o_proj.weight", (D, H * Dv), "linear"
        m = p + "mlp."
        if l < fields["first_k_dense_replace"]:
            for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
                yield l, m + name + ".weight", shape, "linear"
        else:
            yield l, m + "gate.weight", (E, D), "router"
            yield l, m + "gate.e_score_correction_bias", (E,), "bias"
            Is = Im * fields["n_shared_experts"]
            for prefix, n in [(f"experts.{e}.", Im) for e in range(E)] + [("shared_experts.", Is)]:
                for name, shape in (("gate_proj", (n, D)), ("up_proj", (n, D)), ("down_proj", (D, n))):
                    yield l, m + prefix + name + ".weight", shape, "linear"


def write_safetensors(path, tensors) -> None:
    """A safetensors file (an 8-byte header length, a JSON header, the raw
    bytes) of tensors [(name, dtype, shape, data)], data a numpy array
    holding the tensor's values in order (any numpy dtype of the right
    width: its bytes are written), one tensor at a time."""
    tensors = [(name, dtype, shape, np.ascontiguousarray(data).reshape(-1).view(np.uint8))
               for name, dtype, shape, data in tensors]
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        n = data.size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for _, _, _, data in tensors:
            f.write(data.data)


def write_checkpoint(directory, fields, seed, echo=False):
    """A random DeepSeek-V3-layout checkpoint (bf16, transformers' names,
    checkpoint_tensors) written with numpy alone (no torch), and its
    config.json. echo=True writes a model that mostly repeats its input
    token, and an MTP module that drafts the token it is given: its drafts
    are then often right (speculative decoding's tests): both heads are the
    embedding table, every layer's output projections are scaled by 0.1,
    eh_proj passes the embedding half."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    D = fields["hidden_size"]
    t = {}
    for _, name, shape, kind in checkpoint_tensors(fields):
        if kind == "norm":
            t[name] = rng.uniform(0.5, 1.5, shape)
        elif kind == "bias":
            t[name] = rng.standard_normal(shape) * 0.05
        else:
            t[name] = rng.standard_normal(shape) / (1.0 if kind == "embed" else shape[-1] ** 0.5)
    if echo:
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
        for name in t:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t[name] = t[name] * 0.1
            elif name.endswith("shared_head.head.weight"):
                t[name] = t["model.embed_tokens.weight"]
            elif name.endswith("eh_proj.weight"):
                t[name] = np.concatenate([np.eye(D), np.zeros((D, D))], axis=1)
    write_safetensors(f"{directory}/model.safetensors",
                      [(name, "BF16", np.shape(v), np.asarray(v, np.float32).astype(ml_dtypes.bfloat16))
                       for name, v in t.items()])
    with open(f"{directory}/config.json", "w") as f:
        json.dump(dict(fields, model_type="deepseek_v3"), f)


# DeepSeek-V3's own widths (its config.json), for full-width benchmarks:
# write_fp8_checkpoint with num_hidden_layers cut to what one GPU holds.
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
                   topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, num_attention_heads=128,
                   num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
                   rope_theta=10000.0,
                   rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                   tie_word_embeddings=False, rms_norm_eps=1e-6, num_nextn_predict_layers=1)


def write_fp8_checkpoint(directory, fields, seed, dequantized=False, pool_size=1 << 24, block_jitter=True):
    """A random checkpoint in DeepSeek-V3's own fp8 layout: every projection
    ("linear" in checkpoint_tensors) F8_E4M3 with a weight_scale_inv of
    128 x 128 blocks (powers of two around 1/sqrt(fan-in), a factor of 1/2,
    1 or 2 per block), the rest BF16 (the router's bias F32); one
    safetensors file per layer and model.safetensors.index.json, then
    config.json (with DeepSeek-V3's quantization_config). Fast at full
    width (a 256-expert layer is 11 GB): each tensor's values are a random
    slice of a pool of pool_size N(0, 1) samples (the bytes of a weight
    only matter to a benchmark through the routing, which the routers'
    own random weights decide). dequantized=True writes the same values
    (code times scale, exact in bf16) as BF16 without scales, the
    reference of the fp8 loading path's tests; block_jitter=False the same
    codes with every block of a tensor at one scale (their control: a
    loader that misplaced the blocks' scales would match it)."""
    import os

    import ml_dtypes
    rng = np.random.default_rng(seed)
    samples = rng.standard_normal(pool_size)
    fp8, bf16 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
    pools = {"fp8": samples.astype(fp8)}

    def take(pool, n):
        if n <= pool.size:
            o = int(rng.integers(0, pool.size - n + 1))
            return pool[o:o + n]
        return np.concatenate([take(pool, min(n - k, pool.size)) for k in range(0, n, pool.size)])

    def bf16_pool(scale):
        if scale not in pools:
            pools[scale] = (samples * scale).astype(bf16)
        return pools[scale]

    weight_map, current, out = {}, None, []

    def flush():  # one file per layer, written once the layer is complete
        if out:
            file = "model-head.safetensors" if current < 0 else f"model-layer{current:03d}.safetensors"
            write_safetensors(os.path.join(directory, file), out)
            weight_map.update({t[0]: file for t in out})
            out.clear()

    for layer, name, shape, kind in checkpoint_tensors(fields):
        if layer != current:
            flush()
            current = layer
        n = int(np.prod(shape))
        if kind == "norm":
            out.append((name, "BF16", shape, rng.uniform(0.5, 1.5, shape).astype(bf16)))
        elif kind == "bias":
            out.append((name, "F32", shape, (rng.standard_normal(shape) * 0.05).astype(np.float32)))
        elif kind in ("embed", "router"):
            out.append((name, "BF16", shape, take(bf16_pool(1.0 if kind == "embed" else
                                                           2.0 ** -round(np.log2(shape[-1]) / 2)), n)))
        else:  # "linear": fp8 codes and their block scales
            rows, cols = shape
            jitter = rng.integers(-1, 2, ((rows + 127) // 128, (cols + 127) // 128))
            scale = 2.0 ** (-round(np.log2(cols) / 2) + (jitter if block_jitter else 0 * jitter))
            codes = take(pools["fp8"], n)
            if dequantized:
                full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:rows, :cols]
                out.append((name, "BF16", shape, (codes.astype(np.float64).reshape(shape) * full).astype(bf16)))
            else:
                out.append((name, "F8_E4M3", shape, codes))
                out.append((name + "_scale_inv", "F32", scale.shape, scale.astype(np.float32)))
    flush()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = dict(fields, model_type="deepseek_v3")
    if not dequantized:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


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
    p.add_argument("--full-width", action="store_true",
                   help="DeepSeek-V3's widths in its fp8 layout instead (the first 3 layers dense; "
                        "write_fp8_checkpoint; 11 GB a 256-expert layer)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts (with --full-width; 32: what one GPU of EP8 holds)")
    a = p.parse_args(argv)
    import os
    os.makedirs(a.directory, exist_ok=True)
    if not a.full_width:
        if a.experts is not None:
            p.error("--experts goes with --full-width")
        write_tiny_model(a.directory, layers=a.layers, seed=a.seed, num_nextn_predict_layers=int(a.mtp))
        print(f"moelink: a tiny random model in {a.directory}", flush=True)
        return 0
    fields = dict(DEEPSEEK_V3, num_hidden_layers=a.layers, num_nextn_predict_layers=int(a.mtp), eos_token_id=1)
    if a.experts is not None:
        if a.experts < fields["num_experts_per_tok"] or a.experts % fields["n_group"]:
            p.error(f"--experts = {a.experts} must be a multiple of {fields['n_group']} (the groups) "
                    f"and >= {fields['num_experts_per_tok']} (the experts a token picks)")
        fields["n_routed_experts"] = a.experts
    write_fp8_checkpoint(a.directory, fields, a.seed)
    write_tokenizer(a.directory, fields["vocab_size"])
    print(f"moelink: a random full-width fp8 model in {a.directory}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
