"""The OpenAI-compatible front: HTTP handler threads parse and check each
request, an engine thread owns moelink.Engine (adds, cancels, steps) and
hands each step's outputs to a delivery thread, which writes every streamed
request's events and gathers the others' text while the next step runs."""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

import moelink


@dataclass
class ServerOptions:
    num_pages: int = 256        # KV-cache pages per layer
    page_size: int = 16         # tokens a page (the scheduler's block size)
    max_running: int = 8        # requests a step carries
    token_budget: int = 256     # query tokens a step carries
    max_model_len: int = 1024   # prompt plus output tokens
    num_layers: int = 0         # the first N layers (0: all)
    backend: str = "cpu"
    served_model_name: Optional[str] = None
    max_n: int = 1              # choices a request may ask for
    speculative: bool = False   # MTP drafts, verified each step (needs a checkpoint with an MTP module)
    cuda_graphs: bool = False   # GPU backends: decode steps through CUDA graphs (ModelOptions.decode_graphs)
    prefix_caching: bool = True  # share the KV pages of common prompt prefixes between requests
    decode_kernel: str = "auto"   # GPU backends: MLA decode on "auto", "flashinfer", "flashmla" or "moelink" (MLAOptions)
    prefill_kernel: str = "auto"  # GPU backends: MLA prefill on "auto", "flashinfer" or "moelink"
    head_gemm: str = "bf16"       # the MLA decode's W_UK / W_UV GEMMs: "fp8" or "bf16" (MLAOptions.head_gemm)
    kv_provider: str = "auto"     # --pd: libfabric provider of the KV hand-off (auto: shm for a GPU cache, else tcp)


_KERNELS = ("auto", "flashinfer", "moelink")


def add_model_arguments(p) -> None:
    """The model's command-line options, shared by moelink-serve and its
    engine workers (cluster.py passes them on with model_argv)."""
    p.add_argument("--num-layers", type=int, default=0, help="run the first N layers only (0: all)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="GPU backends: decode steps through one CUDA graph per batch-size bucket")
    p.add_argument("--decode-kernel", default="auto", choices=_KERNELS + ("flashmla",),
                   help="GPU backends: the MLA decode kernel (auto: FlashInfer's where it applies)")
    p.add_argument("--prefill-kernel", default="auto", choices=_KERNELS,
                   help="GPU backends: the MLA prefill kernel (auto: FlashInfer's where it applies)")
    p.add_argument("--head-gemm", default="bf16", choices=("fp8", "bf16"),
                   help="the MLA decode's W_UK / W_UV GEMMs: fp8 (grouped GEMM) or bf16 (cuBLAS)")


def model_options(a) -> dict:
    """ServerOptions' fields from add_model_arguments' parsed options."""
    return dict(num_layers=a.num_layers, cuda_graphs=a.cuda_graphs, decode_kernel=a.decode_kernel,
                prefill_kernel=a.prefill_kernel, head_gemm=a.head_gemm)


def model_argv(o: ServerOptions) -> list:
    """add_model_arguments' options that give ServerOptions o."""
    argv = ["--num-layers", str(o.num_layers), "--decode-kernel", o.decode_kernel,
            "--prefill-kernel", o.prefill_kernel, "--head-gemm", o.head_gemm]
    return argv + (["--cuda-graphs"] if o.cuda_graphs else [])


class RequestError(Exception):
    """A request the server refuses: an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class _Job:
    """One request between a handler thread, the engine thread and the
    delivery thread, which pushes the engine's items for it to its sink (a
    _StreamWriter or a _Gathered)."""

    def __init__(self, prompt, params, sink):
        self.prompt, self.params, self.sink = prompt, params, sink
        self.id: Optional[int] = None
        self.cancelled = False


# The local engine's step loop (Server.step_counts): the server's overhead
# is engine_step_seconds less model_step_seconds; decode_step_seconds /
# decode_steps is the decode step inside the server, comparable with
# tools/bench/model_bench.py's bare step at decode_requests / decode_steps.
STEP_METRICS = [
    ("engine_steps", "rounds of the engine's step loop that ran the model"),
    ("engine_step_seconds", "time in Engine.step (schedule, model step, process outputs)"),
    ("engine_cxx_step_seconds", "Engine.step's C++ part (without the GIL)"),
    ("engine_gil_wait_seconds", "the engine thread's wait for the GIL after each Engine.step"),
    ("model_steps", "model steps"),
    ("model_step_seconds", "time in the model's steps (host clock; they wait for the device)"),
    ("decode_steps", "model steps where every request decoded"),
    ("decode_step_seconds", "time in those steps"),
    ("decode_step_requests", "requests those steps carried"),
    # With --cuda-graphs: how the decode-only steps ran (Model.decode_graph_stats).
    ("decode_graph_replays", "decode steps replayed from a CUDA graph"),
    ("decode_graph_eager_steps", "decode steps run eagerly (a bucket's first step, a failed capture, a misfit schedule)"),
    ("decode_graph_captures", "CUDA graphs captured"),
    ("decode_graph_host_seconds", "those steps' host part: batch layout, copies, attention plans, launch"),
    ("decode_graph_wait_seconds", "those steps' wait for the device and the results after their launch"),
]


class _Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.finished = self.errors = self.tokens = self.cached_tokens = 0
        self.ttft_sum = self.ttft_count = self.itl_sum = self.itl_count = 0.0

    def text(self, running, waiting, kv_usage, drafts=(0, 0), steps=None) -> str:
        """steps: Server.step_counts() (the local engine's), else absent."""
        with self.lock:
            rows = [
                ("moelink_requests_total", "counter", "requests accepted", self.requests),
                ("moelink_requests_finished_total", "counter", "requests finished", self.finished),
                ("moelink_request_errors_total", "counter", "requests refused or failed", self.errors),
                ("moelink_generated_tokens_total", "counter", "output tokens", self.tokens),
                ("moelink_prefix_cache_hit_tokens_total", "counter", "prompt tokens from the prefix cache", self.cached_tokens),
                ("moelink_requests_running", "gauge", "requests in the engine's batch", running),
                ("moelink_requests_waiting", "gauge", "requests queued", waiting),
                ("moelink_kv_cache_usage", "gauge", "share of KV pages held by requests", kv_usage),
                ("moelink_time_to_first_token_seconds_sum", "counter", "time to first token", self.ttft_sum),
                ("moelink_time_to_first_token_seconds_count", "counter", "time to first token", self.ttft_count),
                ("moelink_inter_token_latency_seconds_sum", "counter", "time between tokens", self.itl_sum),
                ("moelink_inter_token_latency_seconds_count", "counter", "time between tokens", self.itl_count),
                ("moelink_spec_drafts_proposed_total", "counter", "MTP drafts sent for verification", drafts[0]),
                ("moelink_spec_drafts_accepted_total", "counter",
                 "MTP drafts accepted (acceptance rate: accepted / proposed)", drafts[1]),
            ]
            for key, help_ in STEP_METRICS if steps else ():
                rows.append((f"moelink_{key}_total", "counter", help_, steps[key]))
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(out) + "\n"


def load_engine(model_dir: str, o: ServerOptions):
    """A moelink.Model of the directory's checkpoint and a moelink.Engine on it."""
    d = Path(model_dir)
    pages_per_request = math.ceil(o.max_model_len / o.page_size)
    model = moelink.Model(str(d / "config.json"), backend=o.backend, max_tokens=o.token_budget,
                          num_pages=o.num_pages, page_size=o.page_size, max_requests=o.max_running,
                          max_pages_per_request=pages_per_request, num_layers=o.num_layers,
                          mtp=o.speculative, decode_graphs=o.cuda_graphs,
                          decode_kernel=o.decode_kernel, prefill_kernel=o.prefill_kernel,
                          head_gemm=o.head_gemm, bootstrap=moelink.TcpBootstrap(0, 1, "127.0.0.1", _free_port(), 30.0))
    model.load_checkpoint(str(d))
    return moelink.Engine(model, num_pages=o.num_pages, page_size=o.page_size,
                          token_budget=o.token_budget, max_running=o.max_running,
                          max_pages_per_request=pages_per_request, speculative=o.speculative,
                          prefix_caching=o.prefix_caching)


class Server:
    """Loads the model directory's tokenizer (and, without a scheduler, its
    model on a local engine thread) and runs the HTTP server."""

    def __init__(self, model_dir: str, options: Optional[ServerOptions] = None,
                 scheduler: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("moelink.serve needs Hugging Face tokenizers: pip install tokenizers") from e
        self.options = o = options or ServerOptions()
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "config.json").read_text())
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        self.chat_template = tok_cfg.get("chat_template")
        self.bos = tok_cfg.get("bos_token") if isinstance(tok_cfg.get("bos_token"), str) else None
        eos = cfg.get("eos_token_id", [])
        self.stop_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        self.model_name = o.served_model_name or d.name
        self.vocab_size = int(cfg["vocab_size"])
        # Requests run on a local engine, or go to moelink-scheduler, which
        # routes them to its engines (moelink.serve.worker processes).
        self.scheduler = scheduler
        self.engine = None if scheduler else load_engine(str(d), o)
        # The engine's counts as the engine thread last saw them: only that
        # thread touches the engine (its step runs without the GIL).
        self._engine_state = (0, 0, o.num_pages)  # running, waiting, available pages
        self._failure = ""  # Engine.failure, copied by the engine thread
        self._drafts = (0, 0)  # MTP drafts proposed, accepted
        self._steps = {key: 0 for key, _ in STEP_METRICS}  # the step loop (step_counts)
        self.metrics = _Metrics()
        self._submit: "queue.Queue[_Job]" = queue.Queue()
        self._jobs = {}  # engine id -> _Job (the engine thread's)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="moelink-engine", daemon=True)
        # A step's outputs go to their requests' sinks from a thread of
        # their own (_deliver_loop), while the engine thread runs the next
        # step (which releases the GIL): the engine thread hands over one
        # list a step instead of touching every request itself.
        self._outbox: "queue.Queue" = queue.Queue()
        self._deliver_thread = threading.Thread(target=self._deliver_loop, name="moelink-deliver", daemon=True)
        self._http: Optional[ThreadingHTTPServer] = None
        self._http_thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ lifecycle

    def start(self, host: str = "127.0.0.1", port: int = 8000):
        if self.engine is not None:
            self._deliver_thread.start()
            self._engine_thread.start()
        handler = type("Handler", (_Handler,), {"server_ref": self})
        self._http = _HTTPServer((host, port), handler)
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="moelink-http", daemon=True)
        self._http_thread.start()
        return self._http.server_address[:2]

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._engine_thread.is_alive():
            self._engine_thread.join(timeout=10)
        if self._deliver_thread.is_alive():
            self._outbox.put(None)
            self._deliver_thread.join(timeout=10)

    def kv_pages_free(self) -> int:
        return self._engine_state[2] if self.engine is not None else 0

    def engine_counts(self):
        """(running, waiting, available pages) as of the engine's last step."""
        return self._engine_state

    def draft_counts(self):
        """(MTP drafts proposed, accepted) as of the engine's last step."""
        return self._drafts

    def _graph_stats(self) -> dict:
        """The local engine's model's decode_graph_stats (the engine thread's)."""
        stats = dict(replays=0, eager_steps=0, captures=0, host_seconds=0.0, wait_seconds=0.0)
        model = getattr(self.engine, "_model", None)
        if model is not None:
            stats.update(model.decode_graph_stats)
        return stats

    def step_counts(self):
        """The local engine's step loop (STEP_METRICS) as of its last step;
        None when the engines are the scheduler's."""
        return self._steps if self.engine is not None else None

    # ------------------------------------------------------------ engine thread

    def submit(self, job: _Job) -> None:
        self._submit.put(job)
        self._wake.set()

    def cancel(self, job: _Job) -> None:
        job.cancelled = True
        self._wake.set()

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    job = self._submit.get_nowait()
                except queue.Empty:
                    break
                try:
                    job.id = self.engine.add(job.prompt, **job.params)
                    self._jobs[job.id] = job
                except ValueError as e:
                    self._outbox.put([(job, ("error", str(e)))])  # in order with any stream's
                except moelink.SystemError as e:  # the engine failed since the request came in
                    self._outbox.put([(job, ("failed", str(e)))])
            for jid, job in list(self._jobs.items()):
                if job.cancelled:
                    self.engine.cancel(jid)
            e = self.engine
            self._engine_state = (e.running, e.waiting, e.available_pages)
            self._drafts = (e.drafts_proposed, e.drafts_accepted)
            if e.idle:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            results = self.engine.step()
            t = e.step_times
            self._steps = dict(engine_steps=self._steps["engine_steps"] + 1,
                               engine_step_seconds=self._steps["engine_step_seconds"] + time.perf_counter() - t0,
                               engine_cxx_step_seconds=t["step_seconds"],
                               engine_gil_wait_seconds=t["gil_wait_seconds"],
                               model_steps=t["steps"], model_step_seconds=t["seconds"],
                               decode_steps=t["decode_steps"], decode_step_seconds=t["decode_seconds"],
                               decode_step_requests=t["decode_requests"],
                               **{f"decode_graph_{k}": v for k, v in self._graph_stats().items()})
            self._failure = e.failure
            delivery = []
            for r in results:
                job = self._jobs.get(r.id)
                if job is None:
                    continue
                if r.tokens or r.finished:
                    delivery.append((job, ("tokens", list(r.tokens), r.finished, r.cached_tokens, r.error)))
                if r.finished:
                    del self._jobs[r.id]
            if delivery:
                self._outbox.put(delivery)

    def _deliver_loop(self) -> None:
        """Pushes each step's outputs to their requests' sinks, in order."""
        while True:
            delivery = self._outbox.get()
            if delivery is None:
                return
            _deliver(delivery, self)

    # ------------------------------------------------------------ requests

    def failure(self) -> str:
        """"" while the local engine serves; else why its model cannot run
        again (Engine.failure, as the engine thread saw it after its last
        step): /health says so and requests get 503."""
        return self._failure

    def prepare(self, body: dict, chat: bool):
        """Checks a completions or chat body; returns (prompt ids, engine
        params, stop strings, stream, include_usage). RequestError otherwise."""
        failure = self.failure()
        if failure:
            raise RequestError(503, f"the engine failed and cannot serve (restart the server): {failure}",
                               None, kind="server_error")
        o = self.options
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"The model '{model}' does not exist (this server serves "
                                    f"'{self.model_name}')", "model", "model_not_found")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                    for m in messages):
                raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
            if not self.chat_template:
                raise RequestError(400, f"the model '{self.model_name}' has no chat template "
                                        "(tokenizer_config.json's chat_template)", "messages")
            import jinja2
            text = jinja2.Environment().from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos or "")
            prompt = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            p = body.get("prompt")
            if isinstance(p, str):
                prompt = self.tokenizer.encode(p, add_special_tokens=False).ids
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                prompt = list(p)
            else:
                raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")
        if not prompt:
            raise RequestError(400, "the prompt has no tokens", "messages" if chat else "prompt")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise RequestError(400, f"a prompt token is outside [0, {self.vocab_size})", "prompt")
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1 or n > o.max_n:
            raise RequestError(400, f"'n' = {n!r} must be an integer in [1, {o.max_n}]", "n")
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(key, 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(400, f"'{key}' = {max_tokens!r} must be an integer >= 1", key)
        if len(prompt) + max_tokens > o.max_model_len:
            raise RequestError(400, f"the prompt's {len(prompt)} tokens plus '{key}' = {max_tokens} "
                                    f"exceed the context of {o.max_model_len} tokens", key,
                                    "context_length_exceeded")
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        top_k = body.get("top_k", 0)
        seed = body.get("seed", 0)
        if not isinstance(temperature, (int, float)) or temperature < 0 or temperature > 2:
            raise RequestError(400, f"'temperature' = {temperature!r} must be in [0, 2]", "temperature")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(400, f"'top_p' = {top_p!r} must be in (0, 1]", "top_p")
        if not isinstance(top_k, int) or top_k < 0:
            raise RequestError(400, f"'top_k' = {top_k!r} must be an integer >= 0", "top_k")
        if seed is None:
            seed = 0
        if not isinstance(seed, int):
            raise RequestError(400, f"'seed' = {seed!r} must be an integer", "seed")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise RequestError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        ignore_eos = body.get("ignore_eos", False)  # vLLM's and SGLang's extension
        if not isinstance(ignore_eos, bool):
            raise RequestError(400, f"'ignore_eos' = {ignore_eos!r} must be true or false", "ignore_eos")
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        params = dict(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                      top_p=float(top_p), seed=seed, stop_tokens=[] if ignore_eos else self.stop_ids)
        return prompt, params, stop, stream, include_usage

    def _scheduler_tokens(self, prompt, params, cancel_box):
        """(new tokens, finished, cached, error) from moelink-scheduler's stream."""
        from moelink.scheduler import SchedulerClient, SchedulerError
        client = SchedulerClient(self.scheduler)
        rid = "srv-" + uuid.uuid4().hex[:20]
        cancel_box.append(lambda: _quiet(client.cancel, rid))
        have, done = 0, False
        try:
            for ev in client.generate(prompt, max_new_tokens=params["max_tokens"], request_id=rid,
                                      temperature=params["temperature"]):
                kind = ev.WhichOneof("kind")
                if kind == "tokens":
                    new = list(ev.tokens.token_ids)[max(0, have - ev.tokens.offset):]
                    have = max(have, ev.tokens.offset + len(ev.tokens.token_ids))
                    if new:
                        yield new, "", 0, ""
                elif kind == "finished":
                    reason = ev.finished.finish_reason or "length"
                    done = True
                    yield [], reason if reason in ("stop", "length") else "stop", ev.finished.cached_tokens, ""
                    return
        except SchedulerError as e:
            raise RequestError(503 if e.code.name == "UNAVAILABLE" else 500,
                               f"the scheduler failed the request: {e}", None, kind="server_error")
        finally:
            if not done:  # the client went away or a stop string ended it
                _quiet(client.cancel, rid)
            client.close()

    def generate(self, prompt, params, stop):
        """moelink-scheduler's engines: yields (text delta, finish reason or
        None, cached tokens, output tokens) as they make tokens; stop
        strings end the text early. (The local engine's requests go through
        run_local.)"""
        cancel_box = []
        source = self._scheduler_tokens(prompt, params, cancel_box)
        out = _TextOutput(self.metrics, self.tokenizer, stop, cancel_box)
        try:
            for tokens, finished, cached, error in source:
                delta, reason, n, end = out.feed(tokens, finished, cached, error)
                yield delta, reason, cached, n
                if end:
                    return
        finally:
            source.close()  # a client that went away: the request is cancelled

    def run_local(self, prompt, params, stop, sink) -> None:
        """A request on the local engine whose outputs the delivery thread
        pushes to `sink` (a _StreamWriter writes a stream's events, a
        _Gathered gathers the text); returns when the request has ended
        (a stream's last bytes written, or its client gone)."""
        job = _Job(prompt, params, sink)
        sink.start(self, job, _TextOutput(self.metrics, self.tokenizer, stop, [lambda: self.cancel(job)]))
        self.submit(job)
        try:
            sink.wait()
        finally:
            self.cancel(job)  # the engine drops it if it still has it


class _TextOutput:
    """A request's output as text, fed one step's tokens at a time
    (generate() for the scheduler's engines; the delivery thread for the
    local engine's _StreamWriter and _Gathered): the text so far, stop
    strings (the text ends before the first; the engine's request is
    cancelled through cancel_box), the request's metrics."""

    def __init__(self, metrics, tokenizer, stop, cancel_box):
        with metrics.lock:
            metrics.requests += 1
        self.metrics, self.stop, self.cancel_box = metrics, stop, cancel_box
        self.t0 = self.last = time.monotonic()
        self.out_ids, self.text, self.sent = [], _IncrementalText(tokenizer), 0
        self.longest_stop = max((len(x) for x in stop), default=0)
        self.cached = 0  # prompt tokens the prefix cache held (the largest count reported)

    def feed_item(self, item):
        """feed() of an engine thread's item: ("tokens", tokens, finished,
        cached, error), or the RequestError of a request the engine refused
        ("error": 400) or of an engine that failed ("failed": 503)."""
        if item[0] == "error":
            raise RequestError(400, item[1], None)
        if item[0] == "failed":
            raise RequestError(503, item[1], None, kind="server_error")
        _, tokens, finished, cached, error = item
        return self.feed(tokens, finished, cached, error)

    def feed(self, tokens, finished, cached, error):
        """(text delta, finish reason or None, output tokens, whether the
        request ended); RequestError for an engine failure."""
        now = time.monotonic()
        m = self.metrics
        with m.lock:
            if tokens and not self.out_ids:
                m.ttft_sum += now - self.t0
                m.ttft_count += 1
            elif tokens:
                m.itl_sum += now - self.last
                m.itl_count += 1
            m.tokens += len(tokens)
            m.cached_tokens += cached
        self.last = now
        self.out_ids += tokens
        self.cached = max(self.cached, cached)
        if finished == "error":
            raise RequestError(500, f"the engine failed: {error}", None, kind="server_error")
        checked = len(self.text.text)  # the text before it held no stop string
        self.text.add(tokens, final=bool(finished))
        full = self.text.text
        reason = {"stop": "stop", "length": "length"}.get(finished)
        # A stop string ends the text before it; a new one overlaps the new text.
        first = min((at for at in (full.find(x, max(0, checked - len(x) + 1)) for x in self.stop) if at >= 0),
                    default=-1)
        if first >= 0:
            full, reason = full[:first], "stop"
        if reason == "stop" and not finished and self.cancel_box:
            self.cancel_box[0]()  # a stop string: the engine's request is no longer needed
        # Text that may be the start of a stop string is held back until it
        # is known not to be (it is never sent, then cut).
        hold = 0 if reason or not self.stop else self.longest_stop - 1
        upto = max(self.sent, len(full) - hold)
        delta, self.sent = full[self.sent:upto], upto
        end = bool(reason or finished)
        if end:
            with m.lock:
                m.finished += 1
        return delta, reason, len(self.out_ids), end


class _Gathered:
    """A non-streamed request's text, gathered by the delivery thread as the
    steps come (its handler thread sleeps until the end): text, finish
    reason, output tokens, cached prompt tokens, or the RequestError that
    ended it."""

    def __init__(self):
        self.text, self.reason, self.n = "", None, 0
        self.error: Optional[RequestError] = None
        self._done = threading.Event()

    def start(self, server, job, text: "_TextOutput") -> None:
        self._out = text

    def push(self, item) -> None:
        if self._done.is_set():
            return
        try:
            delta, self.reason, self.n, end = self._out.feed_item(item)
            self.text += delta
        except RequestError as e:
            self.error, end = e, True
        if end:
            self._done.set()

    def fail(self, why: str) -> None:
        """Ends the request with a server error (_deliver)."""
        if not self._done.is_set():
            self.error = RequestError(500, f"moelink-serve failed the request: {why}", None, kind="server_error")
            self._done.set()

    def wait(self) -> None:
        self._done.wait()

    @property
    def cached(self) -> int:
        return self._out.cached


def _deliver(delivery, server) -> None:
    """The delivery thread's round: each (job, item) to its job's sink. A
    sink that raises (a bug in one request's output) ends that request
    with an error and a cancel; the others' go on (no stream may hang on
    another's failure)."""
    for job, item in delivery:
        try:
            job.sink.push(item)
        except Exception as e:
            server.cancel(job)
            job.sink.fail(f"{type(e).__name__}: {e}")


def _error_event(e: RequestError) -> bytes:
    return b"data: " + json.dumps({"error": e.body()["error"]}).encode() + b"\n\n"


class _StreamWriter:
    """A streamed response's events, written by the delivery thread as each
    step's tokens come (push), so that a step does not wake one handler
    thread a stream: those 128 threads taking the GIL in turn held it when
    the engine thread came back from its step (docs/serve.md). Writes never
    block the delivery thread: what the socket does not take at once waits
    in a backlog that the request's handler thread writes (blocking) while
    the delivery thread appends to it. The handler thread waits in wait()
    until the stream has ended."""

    def __init__(self, sock, chunk, usage_event, include_usage):
        # chunk(delta, reason) -> an event's bytes; usage_event(output tokens,
        # cached prompt tokens) -> the usage event's.
        # A socket with a timeout would wait in send() (Python polls it
        # before a retry), MSG_DONTWAIT or not: the connection stays blocking.
        if sock.gettimeout() is not None:
            raise ValueError("moelink: _StreamWriter needs a blocking socket (no timeout)")
        self.sock, self.chunk, self.usage_event, self.include_usage = sock, chunk, usage_event, include_usage
        self.cond = threading.Condition()
        self.backlog = bytearray()
        self.flushing = False  # the handler thread is writing backlog bytes
        self.done = self.gone = False

    def start(self, server, job, text: "_TextOutput") -> None:
        self.server, self.job, self.text = server, job, text

    def push(self, item) -> None:
        """The delivery thread: one item of the engine's for this request."""
        if self.done:
            return
        try:
            delta, reason, n, end = self.text.feed_item(item)
            data = self.chunk(delta, reason)
            if end:
                usage = self.usage_event(n, self.text.cached) if self.include_usage else b""
                data += usage + b"data: [DONE]\n\n"
        except RequestError as e:
            data, end = _error_event(e), True
        self._write(data)
        if end:
            self._end()

    def fail(self, why: str) -> None:
        """Ends the stream with a server error event (_deliver)."""
        if not self.done:
            self._write(_error_event(RequestError(500, f"moelink-serve failed the request: {why}", None,
                                                  kind="server_error")))
            self._end()

    def _end(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify()

    def _write(self, data: bytes) -> None:
        with self.cond:
            if self.gone:
                return
            if self.flushing or self.backlog:
                self.backlog += data
                self.cond.notify()
                return
        try:
            n = self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            n = 0
        except OSError:  # the client went away: its request is cancelled, its pages freed
            self._gone()
            return
        if n < len(data):
            with self.cond:
                self.backlog += data[n:]
                self.cond.notify()

    def _gone(self) -> None:
        with self.cond:
            self.gone = self.done = True
            self.cond.notify()
        self.server.cancel(self.job)

    def wait(self) -> None:
        """The handler thread: writes the backlog until the stream ends."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.backlog or self.done)
                if not self.backlog:
                    return  # done, everything written (or the client gone)
                chunk, self.backlog, self.flushing = bytes(self.backlog), bytearray(), True
            try:
                self.sock.sendall(chunk)
            except OSError:
                self._gone()
                return
            finally:
                with self.cond:
                    self.flushing = False


def set_switch_interval() -> None:
    """A serving process's GIL switch interval: Python's own 5 ms unless
    MOELINK_SERVE_SWITCH_INTERVAL_US sets another (10 to 5000 us, for A/B
    runs). Shorter is worse: with 128 handler threads streaming, every
    forced switch hands the GIL to one of them rather than to the engine
    thread, so the engine thread waits through a convoy of switches after
    each step. tools/bench/front_bench.py (a stub engine, 7 ms steps, 128
    streams, 3 interleaved rounds on a 2-core machine): the share of the
    decode phase outside the steps, medians, 0.47 at 500 us and 0.14 at
    5000 (the GIL wait after a step included)."""
    v = os.environ.get("MOELINK_SERVE_SWITCH_INTERVAL_US", "")
    us = 5000
    if v:
        try:
            us = int(v)
        except ValueError:
            us = -1
        if not 10 <= us <= 5000:
            raise SystemExit(f"moelink.serve: MOELINK_SERVE_SWITCH_INTERVAL_US = '{v}' must be an integer "
                             "from 10 to 5000 (microseconds)")
    sys.setswitchinterval(us * 1e-6)


class _IncrementalText:
    """The text of a growing list of output tokens, decoded a few tokens at a
    time (decoding the whole output at every token costs O(n^2) in the
    tokenizer, under the GIL the engine thread needs). A token's text can
    depend on the tokens before it (a word's leading space, a character
    split over byte tokens), so new tokens are decoded with the last ones
    already shown (from `prefix` on) and their text is the part past those
    ones' text; text ending in an incomplete character waits for the next
    token (or the last call, final=True)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.text = ""
        self.prefix = self.read = 0  # ids[prefix:read]: context already shown; ids[read:]: not yet shown

    def add(self, ids, final: bool = False) -> None:
        self.ids += ids
        if self.read == len(self.ids):
            return
        shown = self.tokenizer.decode(self.ids[self.prefix:self.read])
        both = self.tokenizer.decode(self.ids[self.prefix:])
        if len(both) > len(shown) and (final or not both.endswith("\ufffd")):
            self.text += both[len(shown):]
            self.prefix, self.read = self.read, len(self.ids)


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the request may be over already
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HTTPServer(ThreadingHTTPServer):
    # The listen backlog: socketserver's default of 5 resets the connections
    # of a burst of clients (64 at once in the load test).
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    server_ref: Server = None
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: metrics say what happened
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: RequestError) -> None:
        with self.server_ref.metrics.lock:
            self.server_ref.metrics.errors += 1
        self._json(e.status, e.body())

    def do_GET(self):
        s = self.server_ref
        if self.path == "/health":
            failure = s.failure()
            self._json(503 if failure else 200, {"status": "error", "error": failure} if failure else {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": s.model_name, "object": "model", "created": 0, "owned_by": "moelink"}]})
        elif self.path == "/metrics":
            if s.engine is not None:
                running, waiting, free = s.engine_counts()
                used = 1.0 - free / s.options.num_pages
            else:  # the engines report theirs to the scheduler
                running = waiting = used = 0
            body = s.metrics.text(running, waiting, used, s.draft_counts(), s.step_counts()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._error(RequestError(404, f"no such path: {self.path}", None, "not_found"))

    def do_POST(self):
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(RequestError(404, f"no such path: {self.path}", None, "not_found"))
            return
        s = self.server_ref
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise RequestError(400, f"the request body is not valid JSON: {e}")
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            prompt, params, stop, stream, include_usage = s.prepare(body, chat)
        except RequestError as e:
            self._error(e)
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        base = {"id": rid, "created": created, "model": s.model_name}
        cached_box = [0]
        usage = lambda n: {"prompt_tokens": len(prompt), "completion_tokens": n,
                           "total_tokens": len(prompt) + n,
                           "prompt_tokens_details": {"cached_tokens": cached_box[0]}}
        if not stream:
            text, reason, n = "", None, 0
            try:
                if s.engine is not None:  # gathered by the delivery thread; this thread waits
                    got = _Gathered()
                    s.run_local(prompt, params, stop, got)
                    if got.error is not None:
                        raise got.error
                    text, reason, n, cached_box[0] = got.text, got.reason, got.n, got.cached
                else:
                    for delta, reason, cached, n in s.generate(prompt, params, stop):
                        text += delta
                        cached_box[0] = max(cached_box[0], cached)
            except RequestError as e:
                self._error(e)
                return
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": reason, "logprobs": None} if chat else
                      {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
            self._json(200, dict(base, object="chat.completion" if chat else "text_completion",
                                 choices=[choice], usage=usage(n)))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event_bytes(choice, extra=None) -> bytes:
            payload = dict(base, object=obj, choices=[choice] if choice else [])
            if extra:
                payload.update(extra)
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        first_box = [True]

        def chunk(delta, reason) -> bytes:
            if chat:
                d = {"content": delta}
                if first_box[0]:
                    d["role"] = "assistant"
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
            first_box[0] = False
            return event_bytes(choice)

        if s.engine is not None:
            # The local engine: the delivery thread writes this stream's
            # events as the steps come (_StreamWriter); this thread waits.
            def usage_event(n, cached):
                cached_box[0] = cached
                return event_bytes(None, {"usage": usage(n)})

            self.wfile.flush()
            s.run_local(prompt, params, stop, _StreamWriter(self.connection, chunk, usage_event, include_usage))
            return
        gen = s.generate(prompt, params, stop)

        def event(data: bytes):
            self.wfile.write(data)
            self.wfile.flush()

        try:
            n = 0
            for delta, reason, cached, n in gen:
                cached_box[0] = max(cached_box[0], cached)
                event(chunk(delta, reason))
            if include_usage:
                event(event_bytes(None, {"usage": usage(n)}))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except RequestError as e:
            event(event_bytes(None, {"error": e.body()["error"]}))
        except (BrokenPipeError, ConnectionResetError):
            gen.close()  # the client went away: its request is cancelled, its pages freed
