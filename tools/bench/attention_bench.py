#!/usr/bin/env python3
"""moelink-attention-bench: MLA decode (moelink.MLAAttention, DeepSeek-V3's
widths, bf16 paged latent cache, page 64) on one GPU with each decode kernel
side by side in one process: moelink's own (decode_kernel="moelink") and
FlashInfer's MLA kernel through moelink (decode_kernel="flashinfer",
FlashInfer 0.7.4's BatchMLAPageAttentionHopper), and the two ceilings the
benchmark measures itself: a device-to-device copy (HBM bandwidth, bytes
read + written) and a dense bf16 matmul (torch.matmul 8192^3).

Heads 128 (TP 1) and 16 (TP 8), batch B, q_len 1 and 2 (MTP), kv length L
(every request the same). For each case:
  moelink_us / flashinfer_us   the attention kernel alone (its GPU time per
  / moelink_flashmla_us        step from torch.profiler, all kernels whose
                               names are the decode kernel's); the last
                               decode_kernel="flashmla" (FlashMLA's kernel
                               as moelink runs it: each query row a request
                               of one token), null in a build without
                               FlashMLA's source
  *_step_us                    the whole attention decode step (forward():
                               projections, the batched W_UK / W_UV GEMMs,
                               the kernel, o_proj), wall time per call with
                               the host's share (FlashInfer's plan reads the
                               batch on the host)
  floor_us                     the larger of the cache bytes (B L 576 x 2) at
                               the copy bandwidth and the kernel's FLOPs
                               (2 B q_len heads L (576 + 512)) at the bf16 peak
  flashmla_us                  with --flashmla DIR (tools/build_flashmla.sh):
                               FlashMLA's bf16 dense decode at 9241ae3
                               (flash_mla_with_kvcache) on the same cache,
                               block table and lengths, with random queries
                               of every head (CUDA events; its scheduler
                               metadata made once a case, as a server would);
                               null without it
Both kernels' outputs are compared before timing (relative L2 of the step's
output), and FlashMLA's against an fp32 reference on the case's first
request, so a fast wrong result cannot win.

With --qkv-a M1,M2,...: the seed's merged qkv_a_proj (q_a_proj 1536 rows
and kv_a_proj_with_mqa 576, padded to 640, one fp8 block-scaled GEMM of N
2176 over K 7168, as MLAAttention runs it) against the two GEMMs apart, on
moelink's dense GEMM (Experts.gemm), each captured in a CUDA graph, at M
tokens; its floor is the larger of the fp8 weights at the copy bandwidth
and its FLOPs at the dense fp8 peak (both measured in the run). Results in
the record's `qkv_a` rows.

--head-gemm bf16|fp8: MLAAttention's head_gemm, the W_UK / W_UV GEMMs
of every step (the record's `head_gemm`).

With --step-kernels: each case's whole step (forward()) kernel by kernel,
the largest exclusive time first (each busy instant counted once:
benchlib.exclusive_us), in its row (`<kernel>_step_kernels`): where the
step's time outside the attention kernel goes.

With --bmm M1,M2,...: the absorbed decode's W_UK / W_UV batched GEMMs as
MLAAttention runs them against torch.bmm in bf16 (the record's `bmm` rows).

With --prefill S1,S2,...: the prefill (MHA form, 128 heads, head dim 192 /
128) of one request's S-token chunk, on an empty cache and after S cached
tokens, through moelink.MLAAttention with each prefill kernel of
--prefill-kernels: "flashinfer" (FlashInfer's Hopper prefill, moelink's
default) and "moelink" (moelink's own, the reference). Per case the
attention kernels alone (torch.profiler), the whole prefill step (wall
time: projections, kv_b_proj's expansion, AppendKV, the attention, o_proj)
and the floor, the attention's causal FLOPs (2 heads (192 + 128) per
query-key pair) at the bf16 peak (the record's `prefill` rows).

    PYTHONPATH=build/python python3 tools/bench/attention_bench.py --json out.json
"""
import argparse
import statistics
import sys
import time

import torch

import moelink
from benchlib import bf16_tflops, copy_gbs, gpu_spans, header, span_profile, write_json

# Kernel names per decode kernel, by the column's name: moelink's
# tensor-core kernels (warpgroup MMAs at latent 512 and more than 32 heads
# on Hopper, else mma.sync) and their merge of split keys (the scalar
# decode_attention_kernel where their shapes do not apply), FlashInfer's,
# and FlashMLA's through moelink (its rows' lengths and tables, scheduler,
# split-KV kernel and merge; a build with FlashMLA's source only).
KERNELS = {"moelink": ("wgmma_decode_kernel", "seesaw_decode_kernel", "tc_decode_kernel", "tc_decode_merge_kernel",
                       "decode_attention_kernel"),
           "flashinfer": ("BatchMLAPageAttentionHopper",),
           "moelink_flashmla": ("flashmla_rows_kernel", "get_mla_metadata_kernel", "flash_fwd_splitkv_mla_kernel",
                                "flash_fwd_mla_combine_kernel")}
# MLAAttention's decode_kernel of each column.
DECODE_KERNEL = {"moelink": "moelink", "flashinfer": "flashinfer", "moelink_flashmla": "flashmla"}
# The prefill's attention kernels: FlashInfer's Hopper prefill and the merge
# of a chunk's two parts (its cached keys, itself) that moelink runs after
# it; moelink's own prefill kernels.
PREFILL_KERNELS = {"flashinfer": ("PrefillWithKVCacheKernel", "prefill_merge_kernel"),
                   "moelink": ("prefill_chunk_kernel", "prefill_begin_kernel", "prefill_finish_kernel",
                               "prefill_merge_kernel")}


def wall_us(fn, iters, warmup=2):
    """Median wall time of fn() with the GPU work it queued (the host's
    share counted: FlashInfer's plan reads the batch on the host)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def events_us(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / iters


def event_device_us(evt):
    """A profiler average's GPU time: device_time_total in newer torch (2.11's
    averages have no cuda_time_total, and a kernel-less one gives 0)."""
    t = getattr(evt, "device_time_total", None)
    return getattr(evt, "cuda_time_total", 0) if t is None else t


def kernel_us(fn, iters, names):
    """GPU time per call of the kernels whose names contain one of `names`."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        if any(n in evt.key for n in names):
            total += event_device_us(evt)
    return total / iters if total > 0 else None


def step_kernels(fn, iters, top=12):
    """The GPU kernels of fn() by name, largest exclusive time per call first
    (benchlib.span_profile: the step's kernels run under programmatic
    dependent launch, and a kernel's span includes its wait for the one
    before): the `top` largest as [name, exclusive us, span us], the busy
    time and the sum of the spans (where a step's time goes)."""
    fn()
    p = span_profile(gpu_spans(fn, iters), iters)
    return {"top": [[k["name"][:120], k["exclusive_us"], k["us"]] for k in p["kernels"][:top]],
            "busy_us": p["busy_us"], "sum_us": p["sum_of_kernels_us"], "kernels": len(p["kernels"])}


def load_flashmla(directory):
    """FlashMLA's Python API from the directory tools/build_flashmla.sh built
    (its module binds the dense decode alone, all this benchmark calls)."""
    sys.path.insert(0, directory)
    import flash_mla
    return flash_mla


def flashmla_case(fm, cache, table, kv_len, B, q_len, heads, scale, iters):
    """FlashMLA's decode on this case (us per call) and its relative L2
    against an fp32 reference on request 0 (causal within the q_len rows)."""
    q = (torch.randn(B, q_len, heads, 576, device="cuda") * 0.5).to(torch.bfloat16)
    k_cache = cache.view(cache.shape[0], cache.shape[1], 1, 576)
    seqlens = kv_len.clone()
    meta, _ = fm.get_mla_metadata()
    out, _ = fm.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, causal=True, softmax_scale=scale)
    # Request 0 against fp32: its keys in order of its pages.
    L = int(kv_len[0])
    keys = cache[table[0].long()].reshape(-1, 576)[:L].float()
    s = torch.einsum("qhd,kd->qhk", q[0].float(), keys) * scale
    pos = torch.arange(L, device="cuda")
    limit = L - q_len + torch.arange(q_len, device="cuda")  # row r sees keys <= L - q_len + r
    s = s.masked_fill(pos[None, None, :] > limit[:, None, None], float("-inf"))
    ref = torch.einsum("qhk,kd->qhd", torch.softmax(s, -1), keys[:, :512])
    rel = ((out[0].float() - ref).norm() / ref.norm()).item()
    us = events_us(lambda: fm.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, causal=True,
                                                     softmax_scale=scale), iters)
    return us, rel


def qkv_a_results(token_counts, iters, bw, fp8_peak, hidden=7168, q_rows=1536, kv_rows=640):
    """The merged qkv_a_proj GEMM against q_a_proj's and kv_a_proj's apart
    (moelink's Experts.gemm), at each token count; both checked against an
    fp32 product of the dequantized operands first."""
    from experts_bench import block_weight, dequant, graph_us, quant_rows
    ex = moelink.Experts(1, 128, hidden, 2048, expected_rows=16)
    w, ws = block_weight(1, q_rows + kv_rows, hidden)
    parts = [(w[0][:q_rows], ws[0][:q_rows // 128]), (w[0][q_rows:], ws[0][q_rows // 128:])]
    out = []
    for m in token_counts:
        x, xs = quant_rows(torch.randn(m, hidden, device="cuda"))
        merged = torch.empty(m, q_rows + kv_rows, dtype=torch.bfloat16, device="cuda")
        apart = [torch.empty(m, p[0].shape[0], dtype=torch.bfloat16, device="cuda") for p in parts]
        fns = {"merged": lambda: ex.gemm(merged, x, xs, w[0], ws[0]),
               "apart": lambda: [ex.gemm(y, x, xs, pw, pws) for y, (pw, pws) in zip(apart, parts)]}
        ref = dequant(x, xs, 1) @ dequant(w[0], ws[0], 128).t()
        for f in fns.values():
            f()
        ex.check()
        errs = {"merged": ((merged.float() - ref).norm() / ref.norm()).item(),
                "apart": ((torch.cat(apart, 1).float() - ref).norm() / ref.norm()).item()}
        for k, e in errs.items():
            if not e < 1e-2:  # measured 1.7e-3 on the dense GEMM (experts_bench)
                raise SystemExit(f"attention_bench: qkv_a {k} at M={m}: relative L2 {e:.2e} against fp32")
        times = {k: graph_us(f, iters, reps=5) for k, f in fns.items()}
        weight_bytes = w.numel() + ws.numel() * 4
        floor = max(weight_bytes / bw * 1e6, 2 * m * w.shape[1] * hidden / fp8_peak * 1e6)
        row = {"tokens": m, "n_merged": q_rows + kv_rows, "k": hidden, "merged_us": times["merged"],
               "apart_us": times["apart"], "floor_us": floor, "rel_l2_vs_fp32": errs}
        print(f"qkv_a M {m:4d}: merged {times['merged']:.1f} us, apart {times['apart']:.1f} us, "
              f"floor {floor:.1f} us (merged / floor {times['merged'] / floor:.2f})", file=sys.stderr)
        out.append(row)
    return out


def bmm_results(token_counts, iters, bw, fp8_peak, heads=128, nope=128, latent=512, v=128):
    """The absorbed decode's two per-head GEMMs, k_b_proj's W_UK^T (q_nope
    [heads, m, 128] -> [heads, m, 512]) and v_b_proj's W_UV ([heads, m, 512]
    -> [heads, m, 128]), as MLAAttention runs them (the 1x128 quantization of
    the activations, then moelink's fp8 block-scaled grouped GEMM, one group
    a head, its tiles chosen for m rows) against torch.bmm in bf16 on the
    same shapes; both checked against an fp32 product first."""
    from experts_bench import block_weight, dequant, graph_us, quant_rows
    out = []
    for m in token_counts:
        ex = moelink.Experts(heads, m, 128, 128, expected_rows=m)
        count = torch.full((heads,), m, dtype=torch.int32, device="cuda")
        for name, k, n in (("w_uk", nope, latent), ("w_uv", latent, v)):
            x = torch.randn(heads, m, k, device="cuda").to(torch.bfloat16)
            w, ws = block_weight(heads, n, k)
            w_bf16 = dequant(w, ws, 128).to(torch.bfloat16)
            xq = torch.empty(heads * m, k, dtype=w.dtype, device="cuda")
            xs = torch.empty(heads * m, k // 128, dtype=torch.float32, device="cuda")
            y = torch.empty(heads, m, n, dtype=torch.bfloat16, device="cuda")
            y_torch = torch.empty_like(y)
            w_t = w_bf16.transpose(1, 2).contiguous()  # [heads, k, n]: torch.bmm's right operand

            def moelink_fn():
                ex.quantize(xq, xs, x.view(heads * m, k))
                ex.grouped_gemm(y, count, xq.view(heads, m, k), xs.view(heads, m, k // 128), w, ws)
            fns = {"moelink": moelink_fn, "torch_bf16": lambda: torch.bmm(x, w_t, out=y_torch)}
            for f in fns.values():
                f()
            ex.check()
            ref = torch.bmm(x.float(), dequant(w, ws, 128).transpose(1, 2))
            errs = {"moelink": ((y.float() - ref).norm() / ref.norm()).item(),
                    "torch_bf16": ((y_torch.float() - ref).norm() / ref.norm()).item()}
            if not errs["moelink"] < 5e-2:  # the 1x128 fp8 quantization of x: a few 1e-2 at most
                raise SystemExit(f"attention_bench: {name} at m={m}: relative L2 {errs['moelink']:.2e} "
                                 "against fp32")
            times = {key: graph_us(f, iters, reps=5) for key, f in fns.items()}
            # Floor: moelink's fp8 weights (and bf16 activations in and out) at the
            # copy bandwidth, or the FLOPs at the fp8 peak.
            bytes_ = w.numel() + ws.numel() * 4 + 2 * heads * m * (k + n)
            floor = max(bytes_ / bw * 1e6, 2 * heads * m * k * n / fp8_peak * 1e6)
            row = {"gemm": name, "tokens": m, "heads": heads, "k": k, "n": n, "moelink_us": times["moelink"],
                   "torch_bf16_us": times["torch_bf16"], "floor_us": floor, "rel_l2_vs_fp32": errs}
            print(f"{name} m {m:4d}: moelink {times['moelink']:.1f} us (quantize + fp8 grouped GEMM), "
                  f"torch bf16 bmm {times['torch_bf16']:.1f} us, floor {floor:.1f} us", file=sys.stderr)
            out.append(row)
    return out


def prefill_results(chunks, kernels, weights, cfg, iters, peak):
    """One request's prefill chunk of S tokens, on an empty cache and after
    S cached tokens, through MLAAttention with each prefill kernel; the
    kernels' outputs compared with each other (relative L2 of the step's
    output) before timing."""
    out = []
    max_s = max(chunks)
    attn = {}
    for k in kernels:
        attn[k] = moelink.MLAAttention("deepseek-v3", device="cuda", prefill_kernel=k, max_tokens=max_s,
                                       max_requests=1, max_pages_per_request=(2 * max_s + 63) // 64)
        attn[k].set_weights(**weights)
    heads = cfg.num_attention_heads
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    for S in chunks:
        for cached in (0, S):
            L = cached + S
            pages = (L + 63) // 64
            cache = (torch.randn(pages, 64, 576, device="cuda") * 0.5).to(torch.bfloat16)
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(1, pages)
            kv_len = torch.tensor([L], device="cuda", dtype=torch.int32)
            q_start = torch.tensor([0, S], device="cuda", dtype=torch.int32)
            x = torch.randn(S, cfg.hidden_size, device="cuda").to(torch.bfloat16)
            outs = {k: torch.empty_like(x) for k in kernels}

            def step(k):
                return lambda: attn[k].forward(outs[k], x, cache, q_start, kv_len, table, num_decode=0)
            for k in kernels:
                step(k)()
                attn[k].check()
            pairs = S * cached + S * (S + 1) // 2  # causal: query i sees cached + i + 1 keys
            row = {"heads": heads, "chunk": S, "cached": cached, "kv_len": L,
                   "floor_us": 2 * heads * pairs * (qk + v) / peak * 1e6}
            if len(kernels) > 1:
                ref = outs[kernels[0]].float()
                row["outputs_rel_l2"] = ((outs[kernels[1]].float() - ref).norm() / ref.norm()).item()
            for k in kernels:
                row[f"{k}_us"] = kernel_us(step(k), iters, PREFILL_KERNELS[k])
                row[f"{k}_step_us"] = wall_us(step(k), iters)
            out.append(row)
            print(f"prefill S {S} cached {cached}: " + ", ".join(
                f"{k} kernel {row[k + '_us'] or float('nan'):.0f} us (step {row[k + '_step_us']:.0f})"
                for k in kernels) + f", floor {row['floor_us']:.0f} us", file=sys.stderr)
    return out


def random_weights(cfg):
    """bf16 weights (moelink quantizes them to fp8 blocks), all heads."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    Rq, R, Dn, Dr, Dv = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                         cfg.qk_rope_head_dim, cfg.v_head_dim)

    def proj(n, k):
        return (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return dict(input_layernorm=ones(D), q_a_proj=proj(Rq, D), q_a_layernorm=ones(Rq),
                kv_a_proj_with_mqa=proj(R + Dr, D), kv_a_layernorm=ones(R),
                q_b_proj=proj(H * (Dn + Dr), Rq), kv_b_proj=proj(H * (Dn + Dv), R),
                o_proj=proj(D, H * Dv))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="128,16", help="heads on the GPU (128: TP 1, 16: TP 8)")
    p.add_argument("--batch", default="1,8,32,64,128")
    p.add_argument("--q-len", default="1,2")
    p.add_argument("--kv", default="1024,5000,16384")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--machine", default="nvidia-h200")
    p.add_argument("--json", default="-")
    p.add_argument("--flashmla", default=None, help="a directory tools/build_flashmla.sh built FlashMLA into")
    p.add_argument("--qkv-a", default="", help="token counts of the merged qkv_a_proj comparison (empty: none)")
    p.add_argument("--bmm", default="", help="token counts of the W_UK / W_UV batched GEMMs against torch.bmm "
                                             "(empty: none)")
    p.add_argument("--head-gemm", default="bf16", choices=("fp8", "bf16"), help="MLAAttention's head_gemm (W_UK / W_UV): bf16 or fp8")
    p.add_argument("--step-kernels", action="store_true",
                   help="record each case's step kernel by kernel (torch.profiler) in its row")
    p.add_argument("--prefill", default="", help="chunk lengths of the prefill comparison (empty: none)")
    p.add_argument("--prefill-kernels", default="flashinfer",
                   help="prefill kernels to time: flashinfer, moelink (moelink's own, the reference; slow)")
    a = p.parse_args()
    prefill_kernels = [k for k in a.prefill_kernels.split(",") if k]
    for k in prefill_kernels:
        if k not in PREFILL_KERNELS:
            p.error(f"--prefill-kernels: unknown kernel {k!r} (allowed: {', '.join(PREFILL_KERNELS)})")
    torch.manual_seed(0)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    heads_list, batches, q_lens, kvs = ints(a.heads), ints(a.batch), ints(a.q_len), ints(a.kv)
    rec = {
        **header("tools/bench/attention_bench.py", a.machine),
        "head_gemm": a.head_gemm,
        "model": "deepseek-v3 attention (D 7168, latent 512 + rotary 64, page 64, bf16 cache)",
        "peers": {"flashinfer": "FlashInfer 0.7.4 BatchMLAPageAttentionHopper via moelink "
                                "(decode_kernel='flashinfer')",
                  "flashmla": "FlashMLA 9241ae3 flash_mla_with_kvcache, bf16 dense decode, sm90a "
                              "(tools/build_flashmla.sh)" if a.flashmla else "not run (--flashmla DIR)"},
    }
    fm = load_flashmla(a.flashmla) if a.flashmla else None
    rec["copy_gbs"] = copy_gbs(a.iters)
    rec["bf16_tflops"] = bf16_tflops(a.iters)
    print(f"copy {rec['copy_gbs']:.0f} GB/s (read + write), bf16 {rec['bf16_tflops']:.0f} TFLOP/s",
          file=sys.stderr)
    # Issue 33's floor: the cache bytes at the copy bandwidth (read + write
    # bytes per second of a device copy), the FLOPs at the bf16 peak.
    bw, peak = rec["copy_gbs"] * 1e9, rec["bf16_tflops"] * 1e12
    cfg = moelink.mla_config("deepseek-v3")
    # The widths moelink-plan --calibrate checks a model against.
    rec["fields"] = {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "q_lora_rank",
                                                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                  "v_head_dim")}
    weights = random_weights(cfg)
    max_b, max_q, max_kv = max(batches), max(q_lens), max(kvs)
    rows = []
    for heads in heads_list:
        tp = cfg.num_attention_heads // heads
        attn = {}
        for k in KERNELS:
            try:
                attn[k] = moelink.MLAAttention("deepseek-v3", device="cuda", decode_kernel=DECODE_KERNEL[k],
                                               head_gemm=a.head_gemm, tp_size=tp, max_tokens=max_b * max_q,
                                               max_requests=max_b, max_pages_per_request=(max_kv + 63) // 64)
            except ValueError as e:  # FlashMLA's column in a build without it
                if k != "moelink_flashmla":
                    raise
                print(f"attention_bench: no {k} column: {e}", file=sys.stderr)
        for m in attn.values():
            m.set_weights(**weights)
        for kv in kvs:
            pages = (kv + 63) // 64
            for B in batches:
                cache = (torch.randn(B * pages, 64, 576, device="cuda") * 0.5).to(torch.bfloat16)
                table = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
                kv_len = torch.full((B,), kv, device="cuda", dtype=torch.int32)
                for q_len in q_lens:
                    n = B * q_len
                    x = torch.randn(n, cfg.hidden_size, device="cuda").to(torch.bfloat16)
                    q_start = torch.arange(0, n + 1, q_len, device="cuda", dtype=torch.int32)
                    outs = {k: torch.empty_like(x) for k in attn}

                    def step(k):
                        return lambda: attn[k].forward(outs[k], x, cache, q_start, kv_len, table,
                                                       num_decode=B)
                    for k in attn:
                        step(k)()
                        attn[k].check()
                    ref = outs["moelink"].float()
                    diff = ((outs["flashinfer"].float() - ref).norm() / ref.norm()).item()
                    row = {"heads": heads, "batch": B, "q_len": q_len, "kv_len": kv,
                           "flashinfer_vs_moelink_rel_l2": diff, "moelink_flashmla_us": None,
                           "moelink_flashmla_step_us": None, "moelink_flashmla_vs_moelink_rel_l2": None}
                    if "moelink_flashmla" in attn:
                        fdiff = ((outs["moelink_flashmla"].float() - ref).norm() / ref.norm()).item()
                        if not fdiff < 3e-2:
                            raise SystemExit(f"attention_bench: FlashMLA through moelink differs from moelink's "
                                             f"kernel by {fdiff:.2e} (heads {heads}, B {B}, q_len {q_len}, kv {kv})")
                        row["moelink_flashmla_vs_moelink_rel_l2"] = fdiff
                    for k in attn:  # interleaved per case
                        names = KERNELS[k]
                        row[f"{k}_us"] = kernel_us(step(k), a.iters, names)
                        row[f"{k}_step_us"] = wall_us(step(k), a.iters)
                        if a.step_kernels:
                            row[f"{k}_step_kernels"] = step_kernels(step(k), a.iters)
                    row["flashmla_us"] = row["flashmla_vs_fp32_rel_l2"] = None
                    if fm is not None:
                        # The timing does not depend on the scale; the check uses the same one.
                        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
                        row["flashmla_us"], row["flashmla_vs_fp32_rel_l2"] = flashmla_case(
                            fm, cache, table, kv_len, B, q_len, heads, scale, a.iters)
                    byte_us = B * kv * 576 * 2 / bw * 1e6
                    flop_us = 2 * n * heads * kv * (576 + 512) / peak * 1e6
                    row["floor_us"] = max(byte_us, flop_us)
                    rows.append(row)
                    us = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
                    print(f"heads {heads:3d} B {B:3d} q {q_len} kv {kv:5d}: moelink "
                          f"{us(row['moelink_us'])} us, flashinfer {us(row['flashinfer_us'])} us, "
                          f"flashmla {us(row['flashmla_us'])} us (in moelink {us(row['moelink_flashmla_us'])}), "
                          f"floor {row['floor_us']:.1f} us; steps {row['moelink_step_us']:.0f} / "
                          f"{row['flashinfer_step_us']:.0f} us; outputs differ {diff:.1e}",
                          file=sys.stderr)
                    for k in attn if a.step_kernels else ():
                        sk = row[f"{k}_step_kernels"]
                        print(f"  {k} step: {sk['kernels']} kernels, busy {sk['busy_us']:.1f} us "
                              f"(spans {sk['sum_us']:.1f}); exclusive: " +
                              "; ".join(f"{n[:60]} {t:.1f}" for n, t, _ in sk["top"]), file=sys.stderr)
                cache = None  # freed before the next case's
    rec["results"] = rows
    if a.qkv_a:
        from experts_bench import dense_fp8_tflops
        rec["dense_fp8_tflops"] = dense_fp8_tflops(a.iters)
        rec["qkv_a"] = qkv_a_results(ints(a.qkv_a), a.iters, bw, rec["dense_fp8_tflops"] * 1e12)
    if a.bmm:
        from experts_bench import dense_fp8_tflops
        if "dense_fp8_tflops" not in rec:
            rec["dense_fp8_tflops"] = dense_fp8_tflops(a.iters)
        rec["bmm"] = bmm_results(ints(a.bmm), a.iters, bw, rec["dense_fp8_tflops"] * 1e12)
    if a.prefill:
        rec["prefill"] = prefill_results(ints(a.prefill), prefill_kernels, weights, cfg, a.iters, peak)
    write_json(rec, a.json)


if __name__ == "__main__":
    main()
