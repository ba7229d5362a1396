"""Driver side: which engine runs on which transport here, and one cell =
one fresh (prefill, decode) pair of worker processes.

A pair gets its own control port, its own environment (the transport's
variables, recorded in the result), its own log files, and a deadline: a
worker that hangs or outlives a failed peer is killed (its own process
group, started by us), so a bad cell fails alone, never the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import common
from common import Case

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("moelink", "nixl", "mooncake")
WORKERS = {e: os.path.join(HERE, f"{e}_worker.py") for e in ENGINES}

# Each engine on its best transport of each class on this host's loopback.
TRANSPORTS: Dict[str, Dict[str, Optional[Dict[str, Any]]]] = {
    "moelink": {
        "shm": {"env": {}, "what": "libfabric shm provider"},
        "tcp": {"env": {"FI_TCP_IFACE": "lo"}, "what": "libfabric tcp;ofi_rxm over lo"},
    },
    "nixl": {
        # sm = UCX's shared-memory transports: puts go by cma (process_vm_writev,
        # zero-copy), active messages by sysv/posix; cma alone has no AM
        # transport and fails ("no active messages transport").
        "shm": {"env": {"UCX_TLS": "sm,self"}, "what": "UCX sm (cma puts, sysv/posix AM)"},
        # Without UCX_NET_DEVICES UCX stripes over tcp/lo and tcp/eth0.
        "tcp": {"env": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}, "what": "UCX tcp over lo"},
    },
    "mooncake": {
        "shm": None,
        # Per-peer queue and admission limits raised to their maxima, as vLLM/
        # SGLang deployments over tcp do: the defaults (1,024 queued + 1,024
        # waiting, 1 s admission timeout) reject a 16-request batch of
        # DeepSeek pages ("TCP lane queue-full rejection"), status -1.
        "tcp": {"env": {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535", "MC_TCP_ADMISSION_TIMEOUT_MS": "120000"},
                "what": "Mooncake TcpTransport (asio), P2PHANDSHAKE"},
    },
}

UNAVAILABLE = {
    ("mooncake", "shm"): (
        "no shared-memory transport in this Mooncake wheel: initialize(..., protocol='shm') returns 0 "
        "but installs TcpTransport ('TcpTransport: listen on port ...'; 'shm' only selects the buffer "
        "allocator), MC_USE_TENT=1 is ignored (no TENT backend, which has the shm transport, compiled "
        "in); its tcp transport is measured in the tcp class"),
}


def probe_engine(engine: str, timeout_s: float = 120) -> Dict[str, Any]:
    """Imports the engine in a worker process: {"ok", "version"} or {"ok": False, "error"}."""
    try:
        p = subprocess.run([sys.executable, WORKERS[engine], "--probe"], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"probe timed out after {timeout_s:g} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"ok": False, "error": f"probe exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}


def transport_env(engine: str, transport: str) -> Optional[Dict[str, str]]:
    t = TRANSPORTS[engine].get(transport)
    return None if t is None else dict(t["env"])


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the worker's own group (start_new_session)
        except ProcessLookupError:
            pass
        p.wait()


def cell_timeout(case: Case) -> float:
    """Generous: setup + every iteration at >= 50 MB/s plus verification."""
    n = case.warmup + case.iters
    return 90.0 + n * case.iteration_bytes / 50e6 + (case.src_pool_bytes + case.dst_pool_bytes) / 100e6


def run_pair(engine: str, case: Case, workdir: str, tag: str, timeout_s: Optional[float] = None,
             op_timeout_s: float = 60.0, extra_decode_args: Optional[List[str]] = None,
             extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Runs one cell; returns the merged result (never raises for a worker failure)."""
    env_vars = transport_env(engine, case.transport)
    cell: Dict[str, Any] = {"engine": engine, "transport": case.transport, "case": case.name,
                            "model": case.model, "tokens": case.tokens, "concurrency": case.concurrency}
    if env_vars is None:
        cell.update(ok=False, skipped=True, short=f"no {case.transport} transport here",
                    reason=UNAVAILABLE.get((engine, case.transport), "transport not available"))
        return cell
    env_vars.update(extra_env or {})
    cell["env"] = env_vars
    os.makedirs(workdir, exist_ok=True)
    case_path = os.path.join(workdir, f"{tag}.case.json")
    with open(case_path, "w") as f:
        f.write(case.to_json())
    port = common.free_port()
    env = dict(os.environ, **env_vars)
    timeout_s = timeout_s or cell_timeout(case)
    op_timeout_s = max(op_timeout_s, 30.0 + case.iteration_bytes / 50e6)  # one iteration at >= 50 MB/s
    procs, outs, logs = {}, {}, {}
    t0 = time.monotonic()
    for role in ("decode", "prefill"):
        outs[role] = os.path.join(workdir, f"{tag}.{role}.json")
        logs[role] = os.path.join(workdir, f"{tag}.{role}.log")
        if os.path.exists(outs[role]):
            os.unlink(outs[role])
        args = [sys.executable, WORKERS[engine], "--role", role, "--case", "@" + case_path,
                "--control", f"127.0.0.1:{port}", "--out", outs[role], "--timeout", str(op_timeout_s)]
        if role == "decode":
            args += extra_decode_args or []
        with open(logs[role], "wb") as log:
            procs[role] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = t0 + timeout_s
    failed_at: Optional[float] = None
    killed: Dict[str, str] = {}
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs.values()):
            failed_at = now
        why = (f"killed: cell timeout of {timeout_s:.0f} s" if now > deadline else
               "killed 10 s after its peer failed" if failed_at is not None and now > failed_at + 10
               else None)
        if why:
            for role, p in procs.items():
                if p.poll() is None:
                    killed[role] = why
                    _kill(p)
            break
        time.sleep(0.05)
    cell["wall_s"] = time.monotonic() - t0
    cell["rc"] = {role: p.returncode for role, p in procs.items()}
    errors = []
    for role in ("decode", "prefill"):
        try:
            with open(outs[role]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"ok": False, "error": "no result written"}
        cell[role] = res
        if role in killed:
            errors.append(f"{role} {killed[role]}")
        elif not res.get("ok"):
            errors.append(f"{role}: {res.get('error', '?')}")
        if not res.get("ok") or role in killed:
            cell[role + "_log_tail"] = _tail(logs[role])
    cell["ok"] = not errors and all(rc == 0 for rc in cell["rc"].values())
    if not cell["ok"]:
        cell["error"] = "; ".join(errors) or f"exit codes {cell['rc']}"
    return cell
