"""A scheduler and simulated engines as local processes, for trying policies,
tests and benchmarks:

    from moelink.scheduler.local_cluster import LocalCluster
    with LocalCluster(engines=4, policy="ttft", time_scale=0.1) as cluster:
        client = SchedulerClient(cluster.target)
        ...
        cluster.kill_engine(2)          # SIGKILL; restart_engine(2) brings it back
        cluster.restart_scheduler()     # same port (and --request-log, if given)

The binaries (moelink-scheduler, moelink-engine-sim) come from `bin_dir`,
$MOELINK_BIN_DIR, or PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence


def find_binary(name: str, bin_dir: Optional[str] = None) -> Optional[str]:
    for d in (bin_dir, os.environ.get("MOELINK_BIN_DIR")):
        if d and os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return shutil.which(name)


def _wait_for(path: str, proc: subprocess.Popen, what: str, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout} s:\n{_tail(log)}")
        time.sleep(0.01)


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class LocalCluster:
    def __init__(self, engines: int = 4, *, policy: str = "ttft", bin_dir: Optional[str] = None,
                 block_size: int = 16, kv_blocks: int = 8192, max_batch: int = 64,
                 time_scale: float = 1.0, scheduler: bool = True, http: bool = False,
                 request_log: bool = False, engine_token: Optional[str] = None,
                 scheduler_args: Sequence[str] = (), sim_args: Sequence[str] = (),
                 stream_interval: int = 1, workdir: Optional[str] = None):
        self.scheduler_bin = find_binary("moelink-scheduler", bin_dir)
        self.sim_bin = find_binary("moelink-engine-sim", bin_dir)
        # The simulator only where this cluster starts simulated engines
        # (engines=0: a scheduler for real engines, moelink-serve --engines).
        missing = [name for name, path, needed in (("moelink-scheduler", self.scheduler_bin, scheduler),
                                                   ("moelink-engine-sim", self.sim_bin, engines > 0))
                   if needed and not path]
        if missing:
            raise FileNotFoundError(
                f"{' and '.join(missing)} not found: build moelink (tools/scheduler) "
                "and pass bin_dir, set MOELINK_BIN_DIR, or put them on PATH")
        self.num_engines, self.policy = engines, policy
        self.block_size, self.kv_blocks, self.max_batch = block_size, kv_blocks, max_batch
        self.time_scale, self.with_scheduler, self.http = time_scale, scheduler, http
        self.engine_token = engine_token
        self.scheduler_args, self.sim_args = list(scheduler_args), list(sim_args)
        self.stream_interval = stream_interval
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="moelink-cluster-")
        os.makedirs(self.dir, exist_ok=True)
        self.request_log = os.path.join(self.dir, "requests.log") if request_log else None
        self.port = 0
        self.scheduler_proc: Optional[subprocess.Popen] = None
        self.engines: Dict[int, subprocess.Popen] = {}
        self.http_ports: Dict[int, int] = {}
        self._starts: Dict[int, int] = {}

    # ---------------------------------------------------------------- setup
    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def engine_id(self, i: int) -> str:
        return f"sim-{i}"

    def http_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http_ports[i]}"

    def start(self) -> "LocalCluster":
        if self.with_scheduler:
            self.start_scheduler()
        for i in range(self.num_engines):
            self.start_engine(i)
        return self

    def start_scheduler(self, extra: Sequence[str] = ()) -> None:
        port_file = os.path.join(self.dir, "scheduler.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        args = [self.scheduler_bin, "--listen", f"127.0.0.1:{self.port}", "--port-file", port_file,
                "--policy", self.policy, "--block-size", str(self.block_size)]
        if self.request_log:
            args += ["--request-log", self.request_log]
        if self.engine_token:
            token_file = os.path.join(self.dir, "engine.token")
            with open(token_file, "w") as f:
                f.write(self.engine_token)
            args += ["--engine-token-file", token_file]
        args += self.scheduler_args + list(extra)
        log = os.path.join(self.dir, "scheduler.log")
        self.scheduler_proc = subprocess.Popen(args, stdout=open(log, "a"), stderr=subprocess.STDOUT)
        _wait_for(port_file, self.scheduler_proc, "moelink-scheduler", 20, log)
        with open(port_file) as f:
            self.port = int(f.read())

    def _free_port(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def engine_args(self, i: int) -> List[str]:
        if not self.sim_bin:
            raise FileNotFoundError("moelink-engine-sim not found: build moelink (tools/scheduler) "
                                    "and pass bin_dir, set MOELINK_BIN_DIR, or put it on PATH")
        args = [self.sim_bin, "--engine-id", self.engine_id(i), "--dp-rank", str(i),
                "--kv-blocks", str(self.kv_blocks), "--block-size", str(self.block_size),
                "--max-batch", str(self.max_batch), "--time-scale", str(self.time_scale),
                "--stats-out", os.path.join(self.dir, f"{self.engine_id(i)}.stats.json")]
        if self.with_scheduler:
            args += ["--scheduler", self.target]
        if self.engine_token:
            args += ["--engine-token", self.engine_token]
        if self.http:
            self.http_ports.setdefault(i, self._free_port())
            args += ["--http-port", str(self.http_ports[i]),
                     "--stream-interval", str(self.stream_interval)]
        return args + self.sim_args

    def start_engine(self, i: int, extra: Sequence[str] = ()) -> None:
        n = self._starts[i] = self._starts.get(i, 0) + 1
        ready = os.path.join(self.dir, f"{self.engine_id(i)}.ready{n}")
        log = os.path.join(self.dir, f"{self.engine_id(i)}.log")
        proc = subprocess.Popen(self.engine_args(i) + ["--ready-file", ready] + list(extra),
                                stdout=open(log, "a"), stderr=subprocess.STDOUT)
        self.engines[i] = proc
        _wait_for(ready, proc, f"moelink-engine-sim {self.engine_id(i)}", 30, log)

    # ---------------------------------------------------------------- failures
    def kill_engine(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.engines[i].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.engines[i].wait(timeout=30)

    def restart_engine(self, i: int) -> None:
        if self.engines[i].poll() is None:
            self.kill_engine(i)
        self.start_engine(i)

    def kill_scheduler(self, sig: int = signal.SIGKILL) -> None:
        self.scheduler_proc.send_signal(sig)
        self.scheduler_proc.wait(timeout=30)

    def restart_scheduler(self) -> None:
        if self.scheduler_proc and self.scheduler_proc.poll() is None:
            self.kill_scheduler()
        self.start_scheduler()

    # ---------------------------------------------------------------- teardown
    def stop(self) -> Dict[str, dict]:
        """Stops every process (engines first, with SIGTERM so they write their
        stats) and returns the engines' stats files by engine id."""
        for proc in self.engines.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.engines.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.scheduler_proc and self.scheduler_proc.poll() is None:
            self.scheduler_proc.terminate()
            try:
                self.scheduler_proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.scheduler_proc.kill()
        stats = {}
        for i in self.engines:
            path = os.path.join(self.dir, f"{self.engine_id(i)}.stats.json")
            if os.path.exists(path):
                with open(path) as f:
                    stats[self.engine_id(i)] = json.load(f)
        return stats

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log") and name != "requests.log":
                out.append(f"== {name}\n{_tail(os.path.join(self.dir, name), 30)}")
        return "\n".join(out)

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
