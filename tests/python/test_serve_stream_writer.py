"""moelink-serve's streamed responses on the local engine
(server._StreamWriter): the delivery thread writes each step's events
without ever blocking on a socket; what a slow client's socket does not
take waits in a backlog that the request's handler thread writes. Over a
socket pair whose reader stalls: every byte arrives, in order, the
delivery thread's pushes return at once, wait() returns only once all is
written; a reader that goes away ends the stream and cancels the request;
an engine error ends it with an error event; one request's output that
raises ends that request alone (the delivery thread goes on)."""

import socket
import threading
import time

import pytest

from moelink.serve.server import _deliver, _Gathered, _Metrics, _StreamWriter, _TextOutput


class _WordTokenizer:
    """Token t reads " w<t>" (the tiny model's tokenizer's shape)."""

    def decode(self, ids):
        return "".join(f" w{t}" for t in ids)


def _text():
    """The request's text as the server keeps it (no stop strings)."""
    return _TextOutput(_Metrics(), _WordTokenizer(), [], [])


class _Server:
    def __init__(self):
        self.cancelled = []

    def cancel(self, job):
        self.cancelled.append(job)


def _writer(sock, include_usage=True):
    w = _StreamWriter(sock, lambda delta, reason: b"data: %s|%s\n\n" % (delta.encode() * 40, str(reason).encode()),
                      lambda n, cached: b"data: usage %d %d\n\n" % (n, cached), include_usage)
    server, job = _Server(), object()
    w.start(server, job, _text())
    return w, server, job


def _pair():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # a small buffer: the backlog fills
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return a, b


def _read_all(sock, out):
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return
        out.append(chunk)


def test_a_stalled_reader_gets_every_event_in_order_and_pushes_never_block():
    a, b = _pair()
    n = 300  # events of about 300 bytes: far beyond the socket's buffers
    w, server, _ = _writer(a)
    waiter = threading.Thread(target=w.wait)
    waiter.start()
    slowest = 0.0
    for t in range(n):
        t0 = time.perf_counter()
        w.push(("tokens", [t], "length" if t == n - 1 else "", 7 if t == 0 else 0, ""))
        slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 0.5, f"a push blocked for {slowest:.3f} s"
    time.sleep(0.2)
    assert waiter.is_alive(), "wait() returned before the reader took the stream"
    got = []
    reader = threading.Thread(target=_read_all, args=(b, got))
    reader.start()
    waiter.join(20)
    assert not waiter.is_alive(), "wait() did not return after the stream was written"
    a.close()
    reader.join(20)
    data = b"".join(got)
    want = b"".join(b"data: %s|%s\n\n" % ((f" w{t}".encode()) * 40, b"length" if t == n - 1 else b"None")
                    for t in range(n)) + b"data: usage %d 7\n\n" % n + b"data: [DONE]\n\n"
    assert data == want
    assert server.cancelled == []
    b.close()


def test_a_reader_that_goes_away_ends_the_stream_and_cancels_the_request():
    a, b = _pair()
    w, server, job = _writer(a)
    waiter = threading.Thread(target=w.wait)
    waiter.start()
    b.close()
    for t in range(2000):  # until a write finds the socket closed
        w.push(("tokens", [t], "", 0, ""))
        if w.done:
            break
    waiter.join(20)
    assert not waiter.is_alive() and w.gone and server.cancelled == [job]
    w.push(("tokens", [1], "", 0, ""))  # after the end: ignored
    a.close()


@pytest.mark.parametrize("item, status", [(("tokens", [], "error", 0, "CUDA error"), "the engine failed"),
                                          (("error", "max_tokens is too large"), "max_tokens"),
                                          (("failed", "the engine failed"), "the engine failed")])
def test_an_error_ends_the_stream_with_an_error_event(item, status):
    a, b = socket.socketpair()
    w, server, _ = _writer(a)
    w.push(("tokens", [3], "", 0, ""))
    w.push(item)
    w.wait()
    a.close()
    got = []
    _read_all(b, got)
    events = b"".join(got).split(b"\n\n")
    assert events[0].startswith(b"data:  w3") and b'"error"' in events[1] and status.encode() in events[1]
    assert b"[DONE]" not in b"".join(got)
    b.close()


def test_a_socket_with_a_timeout_is_refused():
    a, b = socket.socketpair()
    a.settimeout(5.0)  # its sends would wait for room, MSG_DONTWAIT or not
    with pytest.raises(ValueError, match="blocking socket"):
        _writer(a)
    a.close()
    b.close()


class _Job:
    def __init__(self, sink):
        self.sink = sink


def test_a_sink_that_raises_ends_its_request_alone():
    a, b = socket.socketpair()
    bad, server, _ = _writer(a)
    bad.chunk = lambda delta, reason: 1 / 0  # a bug in one request's output
    good = _Gathered()
    good.start(server, None, _text())
    jobs = [_Job(bad), _Job(good)]
    _deliver([(jobs[0], ("tokens", [1], "", 0, "")), (jobs[1], ("tokens", [1], "", 0, ""))], server)
    _deliver([(jobs[1], ("tokens", [2], "length", 0, ""))], server)
    bad.wait()
    good.wait()
    assert server.cancelled == [jobs[0]] and good.error is None and good.text == " w1 w2" and good.reason == "length"
    a.close()
    got = []
    _read_all(b, got)
    assert b"ZeroDivisionError" in b"".join(got) and b"server_error" in b"".join(got)
    b.close()
