"""The KV-cache transfer workload and the pieces every engine's worker shares.

Workload: a paged KV cache, layer-major on both sides (like vLLM: one
``[num_pages, page_bytes]`` plane per layer; page p of layer l at
``(l * num_pages + p) * page_bytes`` from the pool's start). A request of
``tokens`` tokens covers ``ceil(tokens / tokens_per_page)`` pages per layer;
only the request's tokens move (the last page may be partial).

- the prefill (source) pool is small (``src_pool_pages`` per layer) and every
  request samples its source pages from it WITH replacement, which keeps memory
  bounded whatever the request size;
- the decode (destination) pool holds ``concurrency x request pages`` per
  layer plus some slack; each iteration decode allocates distinct, scattered
  page ids (new ones every iteration) and sends them to prefill, as a real
  decode engine sends its block ids with the request.

Page contents are deterministic in (seed, layer, source page id); prefill sends
one xxh3-64 checksum per source page (and per source page's prefix when the
last page is partial) and decode checks every destination page against the
checksum of the source page mapped to it, then zeroes what it checked and
verifies that nothing else in its pool was written.

Also here: the control channel (length-prefixed pickle over TCP on
127.0.0.1), CPU-time windows (getrusage, all threads of the process) and the
monotonic clock both processes share (they run on one host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import resource
import socket
import struct
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import xxhash

# ------------------------------------------------------------------ models

# Per-layer KV bytes per token and the page ("block") size engines use.
#
# DeepSeek-V3 (MLA; config.json of deepseek-ai/DeepSeek-V3): the cache keeps
#   the compressed latent, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values
#   x 2 bytes (bf16) = 1,152 B per token per layer; num_hidden_layers 61 ->
#   70,272 B per token over all layers; SGLang/vLLM page it in blocks of 64
#   tokens (FlashMLA's block size): page = 64 x 1,152 = 73,728 B.
# Llama-3-70B (GQA; config.json of meta-llama/Meta-Llama-3-70B):
#   num_key_value_heads 8 x head_dim 128 (hidden 8192 / 64 heads) x 2 bytes x
#   2 (K and V) = 4,096 B per token per layer, num_hidden_layers 80; vLLM's
#   default block size 16 -> page = 65,536 B with K and V together in the page.
MODELS: Dict[str, Dict[str, int]] = {
    "deepseek-v3": {"layers": 61, "bytes_per_token_layer": 1152, "tokens_per_page": 64},
    "llama-3-70b": {"layers": 80, "bytes_per_token_layer": 4096, "tokens_per_page": 16},
}

REQUEST_TOKENS = (1024, 5120, 32768)
CONCURRENCY = (1, 16)          # 1: latency; 16: throughput
TRANSPORT_CLASSES = ("shm", "tcp")

DEFAULT_SRC_POOL_PAGES = 128   # per layer; requests sample it with replacement
DST_POOL_SLACK = 1.25          # destination pool = slack x concurrency x request pages
DEFAULT_MEM_BUDGET_GIB = 8.0   # destination pool bytes above this: case skipped

GB = 1e9


@dataclasses.dataclass
class Case:
    """One workload cell: a model geometry, a request size, a concurrency,
    a transport class and the iteration counts (engine-independent)."""

    model: str
    layers: int
    bytes_per_token_layer: int
    tokens_per_page: int
    tokens: int
    concurrency: int
    transport: str                    # "shm" or "tcp" (class, mapped per engine)
    src_pool_pages: int = DEFAULT_SRC_POOL_PAGES
    dst_pool_pages: int = 0           # 0: derived (slack x concurrency x request pages)
    warmup: int = 1
    iters: int = 3
    seed: int = 1
    engine_options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dst_pool_pages:
            need = self.concurrency * self.request_pages
            self.dst_pool_pages = max(need, int(math.ceil(need * DST_POOL_SLACK)))

    # -- geometry
    @property
    def page_bytes(self) -> int:
        return self.tokens_per_page * self.bytes_per_token_layer

    @property
    def request_pages(self) -> int:
        return -(-self.tokens // self.tokens_per_page)

    @property
    def last_page_bytes(self) -> int:
        """Bytes the request's last page carries (the page may be partial)."""
        return (self.tokens - (self.request_pages - 1) * self.tokens_per_page) * self.bytes_per_token_layer

    @property
    def request_bytes(self) -> int:
        return self.layers * self.tokens * self.bytes_per_token_layer

    @property
    def iteration_bytes(self) -> int:
        return self.concurrency * self.request_bytes

    @property
    def dst_pool_bytes(self) -> int:
        return self.layers * self.dst_pool_pages * self.page_bytes

    @property
    def src_pool_bytes(self) -> int:
        return self.layers * self.src_pool_pages * self.page_bytes

    @property
    def name(self) -> str:
        return f"{self.model}/{self.tokens}tok/c{self.concurrency}"

    def page_lengths(self) -> np.ndarray:
        """Bytes written for each page of a request (last one may be partial)."""
        lens = np.full(self.request_pages, self.page_bytes, dtype=np.int64)
        lens[-1] = self.last_page_bytes
        return lens

    def to_json(self) -> str:
        import json
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        import json
        return cls(**json.loads(text))


def model_case(model: str, tokens: int, concurrency: int, transport: str, **kw: Any) -> Case:
    """A case of one of MODELS' geometries."""
    m = MODELS[model]
    return Case(model=model, layers=m["layers"], bytes_per_token_layer=m["bytes_per_token_layer"],
                tokens_per_page=m["tokens_per_page"], tokens=tokens, concurrency=concurrency,
                transport=transport, **kw)


def scale_iterations(case: Case, target_bytes: float = 1.5e9, min_iters: int = 3,
                     max_iters: int = 20) -> Tuple[int, int]:
    """(warmup, iters) so that a cell moves about ``target_bytes`` timed
    (~0.5-3 s on loopback): small requests get more iterations and 2 warmups."""
    iters = int(round(target_bytes / case.iteration_bytes))
    iters = max(min_iters, min(max_iters, iters))
    warmup = 2 if case.iteration_bytes < 256e6 else 1
    return warmup, iters


def budget_skip_reason(case: Case, budget_gib: float) -> Optional[str]:
    """Why a case is skipped under the destination-memory budget, or None."""
    need = case.dst_pool_bytes
    if need > budget_gib * 2**30:
        return (f"destination pool {need / GB:.1f} GB ({case.concurrency} x {case.request_pages} "
                f"pages x {case.layers} layers x {case.page_bytes} B, x{DST_POOL_SLACK} slack) "
                f"exceeds --mem-budget-gib {budget_gib:g} ({budget_gib * 2**30 / GB:.2f} GB)")
    return None


# ------------------------------------------------------------------ pools and content

def alloc_pool(layers: int, pages: int, page_bytes: int) -> np.ndarray:
    """A zeroed, pre-faulted, C-contiguous uint8 pool shaped (layers, pages,
    page_bytes). Touching every page up front keeps first-touch page faults
    out of the timed transfers (a real cache is resident)."""
    pool = np.empty((layers, pages, page_bytes), dtype=np.uint8)
    pool.fill(0)
    return pool


def _page_seed(seed: int, layer: int, page: int) -> List[int]:
    return [seed & 0xFFFFFFFF, 0x6B76, layer, page]


def fill_source_pool(pool: np.ndarray, seed: int) -> None:
    """Fills page p of layer l with PCG64 output seeded by (seed, l, p): the
    content depends on the source page id only, never on pool size or layout."""
    layers, pages, page_bytes = pool.shape
    words = -(-page_bytes // 8)
    for layer in range(layers):
        for page in range(pages):
            raw = np.random.PCG64(_page_seed(seed, layer, page)).random_raw(words)
            pool[layer, page, :] = raw.view(np.uint8)[:page_bytes]


def page_checksums(pool: np.ndarray, nbytes: int) -> np.ndarray:
    """xxh3-64 of the first ``nbytes`` of every page: uint64 array (layers, pages)."""
    layers, pages, _ = pool.shape
    out = np.empty((layers, pages), dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for layer in range(layers):
        plane = pool[layer]
        for page in range(pages):
            out[layer, page] = h(plane[page, :nbytes])
    return out


def source_checksums(pool: np.ndarray, case: Case) -> Dict[str, np.ndarray]:
    """Checksums prefill sends once: of full pages, and of the partial last
    page's prefix when requests end mid-page."""
    sums = {"full": page_checksums(pool, case.page_bytes)}
    if case.last_page_bytes != case.page_bytes:
        sums["last"] = page_checksums(pool, case.last_page_bytes)
    return sums


def alloc_dst_pages(rng: np.random.Generator, case: Case) -> np.ndarray:
    """Distinct, scattered destination page ids: int64 (concurrency, request_pages)."""
    n = case.concurrency * case.request_pages
    ids = rng.choice(case.dst_pool_pages, size=n, replace=False)
    return ids.astype(np.int64).reshape(case.concurrency, case.request_pages)


def pick_src_pages(rng: np.random.Generator, case: Case) -> np.ndarray:
    """Source page ids sampled with replacement: int64 (concurrency, request_pages)."""
    return rng.integers(0, case.src_pool_pages, size=(case.concurrency, case.request_pages),
                        dtype=np.int64)


class VerificationError(Exception):
    """A destination page does not hold its source page's bytes."""


def verify_and_clear(engine: str, pool: np.ndarray, case: Case, dst: np.ndarray, src: np.ndarray,
                     sums: Dict[str, np.ndarray]) -> int:
    """Checks every destination page of every request against the checksum of
    its source page, zeroes the bytes the requests wrote, then checks that the
    whole pool is zero (nothing written outside the request's pages).
    Returns the pages verified; raises VerificationError naming engine,
    request, layer and pages."""
    h = xxhash.xxh3_64_intdigest
    full = sums["full"]
    last = sums.get("last", full)
    pages = case.request_pages
    last_n = case.last_page_bytes
    for r in range(dst.shape[0]):
        for layer in range(case.layers):
            plane = pool[layer]
            for j in range(pages):
                d, s = int(dst[r, j]), int(src[r, j])
                if j + 1 < pages:
                    got, want = h(plane[d]), int(full[layer, s])
                else:
                    got, want = h(plane[d, :last_n]), int(last[layer, s])
                if got != want:
                    raise VerificationError(
                        f"{engine}: verification failed: layer {layer}, request {r} page {j} "
                        f"(decode page {d}, source page {s}): xxh3 {got:#018x}, want {want:#018x}")
    body = dst[:, :-1].ravel()
    if body.size:
        pool[:, body, :] = 0
    pool[:, dst[:, -1], :last_n] = 0
    flat = pool.reshape(-1)
    words = flat[: flat.size // 8 * 8].view(np.uint64)
    if words.any() or flat[words.size * 8:].any():
        nz = int(np.flatnonzero(flat)[0])
        layer, rest = divmod(nz, pool.shape[1] * pool.shape[2])
        page, off = divmod(rest, pool.shape[2])
        raise VerificationError(
            f"{engine}: verification failed: layer {layer}, decode page {page} byte {off} was "
            "written outside the request's pages")
    return dst.shape[0] * case.layers * pages


# ------------------------------------------------------------------ control channel

class Channel:
    """Length-prefixed pickle messages over one TCP connection (decode
    listens, prefill connects). Trusted peers only: both ends are this
    benchmark's own processes on 127.0.0.1."""

    _HDR = struct.Struct("!Q")

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout_s)

    @classmethod
    def listen(cls, host: str, port: int, timeout_s: float) -> "Channel":
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(1)
        srv.settimeout(timeout_s)
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            raise TimeoutError(f"control: no prefill connected to {host}:{port} within {timeout_s:g} s")
        finally:
            srv.close()
        return cls(conn, timeout_s)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> "Channel":
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(socket.create_connection((host, port), timeout=timeout_s), timeout_s)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"control: cannot connect to decode at {host}:{port}: {e}")
                time.sleep(0.02)

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(self._HDR.pack(len(data)) + data)

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("control: peer closed the connection (did it fail? see its log)")
            got += k
        return bytes(buf)

    def recv(self) -> Any:
        try:
            (n,) = self._HDR.unpack(self._exact(self._HDR.size))
            return pickle.loads(self._exact(n))
        except socket.timeout:
            raise TimeoutError("control: no message from the peer within the timeout (is it alive?)")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def parse_hostport(text: str) -> Tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ time and CPU

now_ns = time.monotonic_ns  # one clock for both processes (same host)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads included
    (engine progress threads count)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def percentile(values: List[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear interpolation; None when empty."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@contextlib.contextmanager
def captured_fds(fds: Tuple[int, ...] = (1, 2)) -> Iterator[List[str]]:
    """Captures what native code writes to the given file descriptors (UCX's
    protocol tables, Mooncake's glog lines) while the block runs; the text is
    appended to the yielded list afterwards and echoed to stderr, so logs
    still show it."""
    out: List[str] = []
    saved = {}
    tmp = tempfile.TemporaryFile(mode="w+b")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in fds:
            saved[fd] = os.dup(fd)
            os.dup2(tmp.fileno(), fd)
        yield out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
        tmp.close()
        out.append(text)
        if text:
            os.write(2, text.encode())
