"""What the Python benchmarks share: the record's header (date, machine,
GPU, torch, the exact command, the commit), the copy-bandwidth ceiling and
writing the JSON."""
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys


def header(tool, machine, gpu=True):
    """gpu=False: a CPU run (torch need not be installed)."""
    if gpu:
        import torch
    return {
        "tool": tool,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "gpu": torch.cuda.get_device_name() if gpu else None,
        "torch": torch.__version__ if gpu else None,
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "git_commit": os.environ.get("MOELINK_GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        # The MOELINK_ settings the run was under (A/B switches such as
        # MOELINK_MLA_DECODE_SEESAW), which the command line does not show.
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("MOELINK_") and k != "MOELINK_GIT_COMMIT"},
    }


def free_port():
    """A TCP port of 127.0.0.1 free now (a TcpBootstrap's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_event_us(fn, iters, warmup=3, sync_each=False):
    """Median time of fn() between CUDA events, one pair per call; with
    sync_each, the device drained after every call (no call queued behind
    the previous one)."""
    import torch
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def copy_gbs(iters):
    """Device-to-device copy bandwidth, bytes read + written (eager: inside
    a CUDA graph a copy becomes a memcpy node the copy engines run, slower)."""
    import torch
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_event_us(lambda: dst.copy_(src), iters)
    return 2 * n / (us * 1e-6) / 1e9


def bf16_tflops(iters, n=8192):
    """Dense bf16 matmul peak (torch.matmul n x n x n), TFLOP/s."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = median_event_us(lambda: torch.matmul(a, b), iters)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def gpu_spans(fn, iters):
    """fn()'s GPU work over `iters` calls, from torch.profiler (CUPTI sees
    every kernel and copy of the process, inside CUDA graphs too): a list of
    (start us, end us, name), by start."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def exclusive_us(spans):
    """Each span's share of the busy time (the union of the spans), in the
    order given (by start): the part of it past every earlier span's end.
    Every busy instant counts once, for the kernel that started first among
    those running: a kernel launched early under programmatic dependent
    launch waits for its predecessor, and that wait is the predecessor's
    work, not its own (its span's length would count it twice). A kernel on
    another stream under a longer one counts nothing: the exclusive times
    add up to the busy time, not to the work of each stream."""
    out, end = [], float("-inf")
    for t0, t1, _ in spans:
        out.append(max(0.0, t1 - max(t0, end)))
        end = max(end, t1)
    return out


def span_profile(spans, iters, excl=None):
    """GPU work per call from gpu_spans(): sum_of_kernels_us (the spans'
    lengths), busy_us (their union) and kernels[] by name, each with its
    calls, us (its spans' lengths) and exclusive_us (its share of busy_us,
    exclusive_us(); `excl` where the caller has it already), largest
    exclusive first."""
    if excl is None:
        excl = exclusive_us(spans)
    by_name = {}
    for (t0, t1, name), x in zip(spans, excl):
        k = by_name.setdefault(name, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += t1 - t0
        k[2] += x
    kernels = sorted(({"name": n[:160], "calls": c / iters, "us": t / iters, "exclusive_us": x / iters}
                      for n, (c, t, x) in by_name.items()), key=lambda k: -k["exclusive_us"])
    return {"sum_of_kernels_us": sum(t1 - t0 for t0, t1, _ in spans) / iters,
            "busy_us": sum(excl) / iters, "kernels": kernels}


def write_json(rec, path):
    """`path` "-": standard output."""
    out = json.dumps(rec, indent=1)
    if path == "-":
        print(out)
    else:
        with open(path, "w") as f:
            f.write(out + "\n")


def stacked_bars_svg(path, title, subtitle, rows, groups, unit="us"):
    """A chart of horizontal stacked bars: rows [(row label, [(bar label,
    {group: value})])], each row on its own scale (the times span orders
    of magnitude), groups [(name, colour)] in stacking order, a legend."""
    W, left, right, top, bar_h, gap = 900, 190, 90, 70, 16, 14
    H = top + sum(len(bars) * (bar_h + 3) + gap for _, bars in rows) + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
           f'<text x="{W / 2}" y="40" text-anchor="middle" fill="#555">{subtitle}</text>']
    y = top
    for row_label, bars in rows:
        scale = (W - left - right) / max(max(sum(v.values()) for _, v in bars), 1e-9)
        out.append(f'<text x="8" y="{y + bar_h}" font-weight="bold">{row_label}</text>')
        for label, vals in bars:
            out.append(f'<text x="{left - 6}" y="{y + bar_h - 4}" text-anchor="end" fill="#555">{label}</text>')
            x = left
            for g, colour in groups:
                w = vals.get(g, 0.0) * scale
                if w > 0:
                    out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                               f'<title>{g}: {vals[g]:.1f} {unit}</title></rect>')
                    x += w
            out.append(f'<text x="{x + 5:.1f}" y="{y + bar_h - 4}">{sum(vals.values()):,.0f} {unit}</text>')
            y += bar_h + 3
        y += gap
    x = 10
    for g, colour in groups:
        out.append(f'<rect x="{x}" y="{y + 8}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{x + 16}" y="{y + 18}">{g}</text>')
        x += 34 + 7.5 * len(g)
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
