"""moelink-scheduler, engine workers and the OpenAI front on one machine,
started together (`python -m moelink.serve --model DIR --engines N`): one
address for the user, the scheduler routing each request to the engine
whose prefix cache holds most of its prompt and whose queue is shortest.
With pd=True (--pd) the first half of the engines are prefill workers and
the rest decode workers: the scheduler routes each request to a prefill
worker and names the decode worker it hands the request to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional

from moelink.scheduler.local_cluster import _tail, _wait_for

from .server import Server, ServerOptions, model_argv


class LocalServing:
    def __init__(self, model_dir: str, engines: int = 2, options: Optional[ServerOptions] = None,
                 policy: str = "ttft", bin_dir: Optional[str] = None, workdir: Optional[str] = None,
                 pd: bool = False):
        from moelink.scheduler.local_cluster import LocalCluster
        self.model_dir = model_dir
        self.options = options or ServerOptions()
        self.num_engines = engines
        if pd and engines < 2:
            raise ValueError(f"moelink-serve --pd: engines = {engines}; P/D needs at least 2 "
                             "(a prefill and a decode worker)")
        prefill = max(1, engines // 2)
        self.roles = [("prefill" if i < prefill else "decode") if pd else "mixed" for i in range(engines)]
        self.dir = workdir or tempfile.mkdtemp(prefix="moelink-serve-")
        # The scheduler alone (no simulated engines); its block size is the
        # workers' page size, so block hashes name the same tokens.
        self.scheduler = LocalCluster(engines=0, policy=policy, bin_dir=bin_dir,
                                      block_size=self.options.page_size,
                                      kv_blocks=self.options.num_pages, workdir=self.dir)
        if self.scheduler.scheduler_bin is None:
            raise RuntimeError("moelink-serve --engines needs the moelink-scheduler binary "
                               "(build moelink; set MOELINK_BIN_DIR or put it on PATH)")
        self.workers: List[Optional[subprocess.Popen]] = [None] * engines
        self.front: Optional[Server] = None

    def engine_id(self, i: int) -> str:
        return f"engine-{i}"

    def start(self, host: str = "127.0.0.1", port: int = 8000):
        self.scheduler.start()
        for i in range(self.num_engines):
            self.start_worker(i)
        self.front = Server(self.model_dir, self.options, scheduler=self.scheduler.target)
        return self.front.start(host, port)

    def start_worker(self, i: int, timeout: float = 120.0) -> None:
        o = self.options
        ready = os.path.join(self.dir, f"{self.engine_id(i)}.ready")
        if os.path.exists(ready):
            os.remove(ready)
        log = os.path.join(self.dir, f"{self.engine_id(i)}.log")
        args = [sys.executable, "-m", "moelink.serve.worker", "--model", self.model_dir,
                "--scheduler", self.scheduler.target, "--engine-id", self.engine_id(i),
                "--dp-rank", str(i), "--num-pages", str(o.num_pages), "--page-size", str(o.page_size),
                "--max-running", str(o.max_running), "--token-budget", str(o.token_budget),
                "--max-model-len", str(o.max_model_len), "--backend", o.backend, "--role", self.roles[i],
                "--kv-provider", o.kv_provider,
                "--ready-file", ready]
        args += model_argv(o)
        if o.speculative:
            args.append("--speculative")
        if not o.prefix_caching:
            args.append("--no-prefix-caching")
        # The worker imports this very moelink package, wherever it was found.
        import moelink
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(moelink.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(args, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env)
        self.workers[i] = proc
        _wait_for(ready, proc, f"engine worker {i}", timeout, log)

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.workers[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(timeout=30)
        self.workers[i] = None

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
        for i in range(self.num_engines):
            self.kill_worker(i, signal.SIGTERM)
        self.scheduler.stop()

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                out.append(f"== {name}\n{_tail(os.path.join(self.dir, name), 30)}")
        return "\n".join(out)
