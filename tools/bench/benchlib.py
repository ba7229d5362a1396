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
    }


def free_port():
    """A TCP port of 127.0.0.1 free now (a TcpBootstrap's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_event_us(fn, iters, warmup=3):
    """Median time of fn() between CUDA events, one pair per call."""
    import torch
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
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


def write_json(rec, path):
    """`path` "-": standard output."""
    out = json.dumps(rec, indent=1)
    if path == "-":
        print(out)
    else:
        with open(path, "w") as f:
            f.write(out + "\n")
