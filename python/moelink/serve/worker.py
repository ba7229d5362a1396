"""moelink.serve.worker: a moelink.Engine behind moelink-scheduler. It
registers as an engine of the scheduler's protocol, runs the requests the
scheduler routes to it, and reports after every step: each request's
progress (STARTED, acknowledged before its prefill; its new tokens;
FINISHED), the prefix cache's KV events in moelink block hashes (so the
scheduler's prefix index is exactly what this engine holds) and its load.

    python -m moelink.serve.worker --model DIR --scheduler HOST:PORT --engine-id e0

Prefill/decode disaggregation (--role prefill | decode): a prefill worker
runs each request up to its first token, moves its KV rows to the decode
worker the scheduler named (moelink.serve.disagg: the decode worker's
hand-off service, the TransferEngine) and reports HANDED_OFF; the decode
worker continues it and reports its tokens from there.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
import zlib
from pathlib import Path

from .server import ServerOptions, add_model_arguments, load_engine, model_options, set_switch_interval


class EngineFailedError(RuntimeError):
    """The worker's engine cannot run again (Engine.failure: a CUDA error, a
    dead peer); only a new process serves again."""


class EngineWorker:
    def __init__(self, model_dir: str, scheduler: str, engine_id: str,
                 options: ServerOptions = ServerOptions(), dp_rank: int = 0, role: str = "mixed",
                 kv_provider: str = "auto"):
        from moelink.scheduler import EngineClient
        self.options = options
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        eos = cfg.get("eos_token_id", [])
        self.eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        self.engine = load_engine(model_dir, options)
        self._inbox: "queue.Queue" = queue.Queue()
        self._by_engine = {}   # engine request id -> [scheduler request id, tokens reported]
        self._by_request = {}  # scheduler request id -> engine request id
        self._stop = threading.Event()
        # Reports go to the scheduler in order from a thread of their own
        # (_report_loop): a step's report is on the wire while the engine
        # thread runs the next step (which releases the GIL); a report whose
        # answer the engine thread needs waits for the ones before it.
        self._outbox: "queue.Queue" = queue.Queue()
        self._reporter = threading.Thread(target=self._report_loop, name="moelink-report", daemon=True)
        # The engine's load as of its last step: the client's heartbeat
        # thread reads this, never the engine (its step runs without the GIL).
        self._counts = (0, 0, options.num_pages)
        self.engine_id, self.role = engine_id, role
        self._handoff = {}  # engine request id -> (decode engine id, its hand-off address)
        self._decoders = {}  # a decode worker's hand-off address -> HandoffClient
        self.kv_port = self.handoff_server = None
        handoff_address = ""
        if role != "mixed":
            from .disagg import HandoffServer, KvPort
            self.kv_port = KvPort(self.engine._model, engine_id, provider=kv_provider)
            if role == "decode":
                self.handoff_server = HandoffServer(self._handoff_request)
                handoff_address = self.handoff_server.address
        self.client = EngineClient(scheduler, engine_id, kv_capacity_blocks=options.num_pages,
                                   block_size=options.page_size, max_batch=options.max_running,
                                   on_run=lambda run: self._inbox.put(("run", run)),
                                   on_cancel=lambda c: self._inbox.put(("cancel", c.request_id)),
                                   load=self._load, dp_rank=dp_rank, role=role,
                                   handoff_address=handoff_address)

    def _report(self, progress_reports, kv_events=(), wait: bool = False):
        """Sends a report after the ones queued before it: returns its
        ReportResult with wait, else at once. Without the reporter thread
        (not started, or stopped) it is sent here."""
        args = (self._load(), kv_events, progress_reports)
        if not self._reporter.is_alive():
            return self.client.report(*args)
        reply = queue.Queue(maxsize=1) if wait else None
        self._outbox.put((args, reply))
        while wait:
            try:
                return reply.get(timeout=1.0)
            except queue.Empty:
                if not self._reporter.is_alive():  # stopped meanwhile
                    try:
                        return reply.get_nowait()  # sent just before it stopped
                    except queue.Empty:
                        return self.client.report(*args)  # never sent: here
        return None

    def _report_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            args, reply = item
            try:
                result = self.client.report(*args)
            except Exception as e:  # the client reports RPC failures as results; anything else ends up here
                import grpc
                from moelink.scheduler import ReportResult
                result = ReportResult(False, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")
            if reply is not None:
                reply.put(result)

    def _load(self):
        from moelink.scheduler import load
        running, waiting, free = self._counts
        return load(running=running, waiting=waiting, free_kv_blocks=free)

    def _kv_events(self):
        from moelink.scheduler import cleared_event, removed_event, stored_event
        cleared, events = self.engine.take_kv_events()
        out = [cleared_event()] if cleared else []
        for kind, hashes, parent in events:
            out.append(stored_event(hashes, parent) if kind == "stored" else removed_event(hashes))
        return out

    def start(self, timeout: float = 30.0) -> "EngineWorker":
        self.client.start(timeout)
        self._reporter.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._reporter.is_alive():
            self._outbox.put(None)  # after the reports queued before it
            self._reporter.join(timeout=30)
        self.client.close()
        if self.handoff_server is not None:
            self.handoff_server.close()
        for c in self._decoders.values():
            c.close()

    # ------------------------------------------------------------ P/D, decode side

    def _handoff_request(self, message: dict) -> dict:
        """A hand-off service call (service thread): queued to the engine
        thread, answered from there."""
        reply: "queue.Queue" = queue.Queue()
        self._inbox.put(("handoff", (message, reply)))
        return reply.get(timeout=60)

    def _handoff_on_engine(self, message: dict) -> dict:
        from .disagg import next_imm_base
        op, rid = message.get("op"), message.get("request_id", "")
        if op == "receive":
            sp = message["sampling"]
            got = self.engine.receive(message["prompt"], max_tokens=sp["max_tokens"],
                                      temperature=sp["temperature"], seed=sp["seed"],
                                      stop_tokens=sp["stop_tokens"])
            if got is None:
                return {"ok": False, "error": f"decode engine '{self.engine_id}' has no free KV pages now"}
            did, cached, pages = got
            self._by_engine[did] = [rid, 1]  # the prefill engine reported the first token
            self._by_request[rid] = did
            return {"ok": True, "cached": cached, "pages": list(pages), "imm_base": next_imm_base(),
                    "cache": self.kv_port.describe()}
        did = self._by_request.get(rid)
        if did is None:
            return {"ok": False, "error": f"request '{rid}' was not received here"}
        if op == "resume":
            try:
                self.kv_port.wait(message["prefill"], message["prompt_len"], message["src_pages"],
                                  message["dst_pages"], message["cached"], message["imm_base"])
                self.engine.resume(did, message["first_token"])
            except Exception:
                self.engine.cancel(did)  # its pages come back at the next step
                raise
            return {"ok": True}
        if op == "abort":
            self.engine.cancel(did)
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ------------------------------------------------------------ P/D, prefill side

    def _hand_off(self, eid: int, rid: str, offset: int, first_token: int, prompt, sampling) -> list:
        """Moves a handed-off request to its decode engine; the reports to send."""
        from moelink.scheduler import FAILED, HANDED_OFF, progress
        from .disagg import HandoffClient
        to, address = self._handoff.pop(eid)
        pages = self.engine.pages(eid)
        try:
            if address not in self._decoders:  # by address: a restarted decode worker has a new one
                self._decoders[address] = HandoffClient(address)
            dec = self._decoders[address]
            got = dec.call({"op": "receive", "request_id": rid, "prompt": list(prompt), "sampling": sampling})
            if not got.get("ok"):
                raise RuntimeError(got.get("error", "receive refused"))
            sent = dict(prefill=self.engine_id, prompt_len=len(prompt), src_pages=pages, dst_pages=got["pages"],
                        cached=got["cached"], imm_base=got["imm_base"])
            self.kv_port.send(got["cache"], len(prompt), pages, got["pages"], got["cached"], got["imm_base"])
            # The scheduler moves the request before the decode engine reports it.
            result = self._report([progress(rid, HANDED_OFF, [first_token], offset, handed_to=to)], wait=True)
            if not result.ok or rid in result.revoked:
                dec.call({"op": "abort", "request_id": rid})
                return []
            ok = dec.call(dict(sent, op="resume", request_id=rid, first_token=first_token))
            if not ok.get("ok"):
                raise RuntimeError(ok.get("error", "resume refused"))
            return []
        except Exception as e:
            stale = self._decoders.pop(address, None)
            if stale is not None:
                try:  # the decode side frees what it reserved (it may be gone)
                    stale.call({"op": "abort", "request_id": rid})
                except Exception:
                    pass
                stale.close()
            return [progress(rid, FAILED, (), offset, 0, f"hand-off to '{to}' failed: {e}"[:200])]
        finally:
            self.engine.release(eid)

    def serve_forever(self) -> None:
        """Steps until stopped. Once the engine has failed (Engine.failure),
        reports every request it held or was sent as FAILED, answers pending
        hand-off calls with the error and raises EngineFailedError: the
        process must go for a new one to serve (main() exits with status 1)."""
        while not self._stop.is_set():
            self.step_once()
            if self.engine.failure:
                self._fail_everything()
                raise EngineFailedError(f"engine '{self.engine_id}' failed: {self.engine.failure}")

    def _fail_everything(self) -> None:
        from moelink.scheduler import FAILED, progress
        why = f"engine '{self.engine_id}' failed: {self.engine.failure}"[:200]
        reports = [progress(rid, FAILED, (), offset, 0, why) for rid, offset in self._by_engine.values()]
        self._by_engine.clear()
        self._by_request.clear()
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "run":
                reports.append(progress(item.request_id, FAILED, (), 0, 0, why))
            elif kind == "handoff":
                item[1].put({"ok": False, "error": why})
        if reports:
            self._report(reports, wait=True)

    def step_once(self) -> None:
        from moelink.scheduler import FINISHED, RUNNING, STARTED, progress
        e = self.engine
        self._counts = (e.running, e.waiting, e.available_pages)
        started = []
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.02 if self.engine.idle and not started else 0)
            except queue.Empty:
                break
            if kind == "run":
                started.append(item)
            elif kind == "handoff":
                message, reply = item
                try:
                    reply.put(self._handoff_on_engine(message))
                except Exception as e:
                    reply.put({"ok": False, "error": f"{type(e).__name__}: {e}"})
            elif item in self._by_request:
                self.engine.cancel(self._by_request[item])
        if started:
            # STARTED, acknowledged, before the prefill: a request the
            # scheduler meanwhile gave to another engine is revoked here.
            result = self._report([progress(r.request_id, STARTED) for r in started], wait=True)
            revoked = set(result.revoked) if result.ok else {r.request_id for r in started}
            for run in started:
                if run.request_id in revoked:
                    continue
                stops = [] if run.sampling.ignore_eos else self.eos
                hand_off = bool(run.decode_engine_id) and self.kv_port is not None
                eid = self.engine.add(list(run.prompt_tokens), max_tokens=run.sampling.max_new_tokens,
                                      temperature=run.sampling.temperature, stop_tokens=stops,
                                      seed=zlib.crc32(run.request_id.encode()), hand_off=hand_off)
                self._by_engine[eid] = [run.request_id, 0]
                self._by_request[run.request_id] = eid
                if hand_off:
                    self._handoff[eid] = (run.decode_engine_id, run.decode_handoff_address,
                                          list(run.prompt_tokens),
                                          dict(max_tokens=run.sampling.max_new_tokens,
                                               temperature=run.sampling.temperature,
                                               seed=zlib.crc32(run.request_id.encode()), stop_tokens=stops))
        if self.engine.idle:
            return
        reports = []
        for r in self.engine.step():
            rid, offset = self._by_engine.get(r.id, (None, 0))
            if rid is None:
                continue
            if r.cached_tokens:
                # Known once the engine admitted it (its first step): the
                # protocol takes cached tokens with STARTED, which may come
                # again while the request runs.
                reports.append(progress(rid, STARTED, cached_tokens=r.cached_tokens))
            if r.finished == "cancelled":
                pass  # the scheduler cancelled it: nothing more to say
            elif r.finished == "handed_off":
                to, address, prompt, sampling = self._handoff[r.id]
                self._handoff[r.id] = (to, address)
                reports += self._hand_off(r.id, rid, offset, r.tokens[0], prompt, sampling)
            elif r.finished in ("stop", "length"):
                reports.append(progress(rid, FINISHED, r.tokens, offset, finish_reason=r.finished))
            elif r.finished == "error":
                from moelink.scheduler import FAILED
                reports.append(progress(rid, FAILED, (), offset, 0, r.error[:200]))
            elif r.tokens:
                reports.append(progress(rid, RUNNING, r.tokens, offset))
            self._by_engine[r.id][1] += len(r.tokens)
            if r.finished:
                del self._by_engine[r.id]
                self._by_request.pop(rid, None)
        self._counts = (e.running, e.waiting, e.available_pages)
        self._report(reports, self._kv_events())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelink.serve.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--scheduler", required=True, help="the scheduler's engine address, HOST:PORT")
    p.add_argument("--engine-id", required=True)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16, help="must equal the scheduler's --block-size")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--backend", default="cpu", help="the model's backend: cpu, or nvlink (the GPU path)")
    p.add_argument("--speculative", action="store_true", help="verify the model's MTP drafts")
    add_model_arguments(p)
    p.add_argument("--no-prefix-caching", action="store_true", help="never share KV pages between requests")
    p.add_argument("--role", default="mixed", choices=("mixed", "prefill", "decode"),
                   help="P/D disaggregation: prefill (hands requests off after their first token) or "
                        "decode (continues them); mixed runs requests whole")
    p.add_argument("--kv-provider", default="auto",
                   help="libfabric provider of the KV hand-off (tcp, shm, ...; auto: shm for a GPU cache, else tcp)")
    p.add_argument("--ready-file", default=None, help="written once registered")
    a = p.parse_args(argv)
    set_switch_interval()
    opts = ServerOptions(num_pages=a.num_pages, page_size=a.page_size, max_running=a.max_running,
                         token_budget=a.token_budget, max_model_len=a.max_model_len, backend=a.backend,
                         speculative=a.speculative, prefix_caching=not a.no_prefix_caching,
                         **model_options(a))
    w = EngineWorker(a.model, a.scheduler, a.engine_id, opts, a.dp_rank, a.role, a.kv_provider).start()
    signal.signal(signal.SIGTERM, lambda *_: w._stop.set())
    if a.ready_file:
        Path(a.ready_file).write_text("ready\n")
    try:
        w.serve_forever()
    except EngineFailedError as e:
        print(f"moelink.serve.worker: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        w.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
