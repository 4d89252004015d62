"""The services' HTTP server holds every request to its application's read deadlines
(runtime/deadlines.py, runtime/server.py): a head or body that does not arrive in time, or a
body trickling below the minimum rate, is answered ``408`` and its connection closed, the
handler waiting for the body sees the client gone, and the cut is counted; time the server
itself holds a body back does not count. Real uvicorn, real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from runtime.deadlines import DeadlineSettings, ReadDeadlines, ReadGuard
from runtime.server import Answer, DirectHandler, Headers

from ..support import served, wait_until

#: Bytes of ``GET /big``'s answer.
BIG = 200 * 1024
#: Short deadlines so each test takes about a second.
DEADLINES = ReadDeadlines(head_seconds=0.6, body_seconds=0.8, body_min_rate=0, body_rate_grace=0)


class Guarded:
    """An app with the given deadlines: ``POST /asgi`` (FastAPI) and ``POST /direct`` (a
    direct route) read the whole body and answer its length; ``POST /late`` waits 1.5 s (longer
    than any deadline here) before it reads its body. What each handler saw is in ``seen``,
    what the server cut in ``cuts``."""

    def __init__(self, deadlines: ReadDeadlines = DEADLINES) -> None:
        self.app = FastAPI()
        self.seen: list[str] = []
        self.cuts: list[str] = []
        self.app.state.read_guard = ReadGuard(deadlines, self.cuts.append)

        @self.app.post("/asgi")
        async def asgi(request: Request) -> Response:
            try:
                body = await request.body()
            except Exception as error:  # the client gone: what the handler saw
                self.seen.append(type(error).__name__)
                return Response(b"{}", 400, media_type="application/json")
            self.seen.append(f"body {len(body)}")
            return Response(b'{"length":%d}' % len(body), media_type="application/json")

        @self.app.get("/big")
        async def big() -> Response:
            return Response(b"x" * BIG, media_type="application/octet-stream")

        @self.app.post("/late")
        async def late(request: Request) -> Response:
            await asyncio.sleep(1.5)
            body = await request.body()
            return Response(b'{"length":%d}' % len(body), media_type="application/json")

    def direct_route(self, method: str, path: str) -> DirectHandler | None:
        return self.direct if (method, path) == ("POST", "/direct") else None

    async def direct(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                self.seen.append(message["type"])
                return 400, b'{"error":"gone","detail":"gone"}', []
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.seen.append(f"body {len(body)}")
        return 200, b'{"length":%d}' % len(body), []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def _read_all(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (monotonic)."""
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer, time.monotonic()


def _error(answer: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, JSON body, whether the head says ``connection: close``) of one answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body), b"connection: close" in head.lower()


def _head(path: str, length: int, *extra: bytes) -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: x", *extra]
    return b"\r\n".join([*lines, b"Content-Length: %d" % length]) + b"\r\n\r\n"


@pytest.mark.parametrize("path", ["/asgi", "/direct"])
def test_a_body_that_stops_arriving_is_a_408_and_the_handler_sees_the_client_gone(
    path: str,
) -> None:
    app = Guarded()
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_head(path, 100) + b"x" * 10)  # a head and one chunk, then nothing
        started = time.monotonic()
        answer, closed = _read_all(sock)
        time.sleep(0.1)  # the handler's task ends on the loop
    status, error, closes = _error(answer)
    held = closed - started
    print(f"{path}: head + 10 of 100 bytes held {held:.2f} s (deadline 0.8 s): {status} {error}")
    assert (status, error["error"], closes) == (408, "body_timeout", True)
    assert "within 0.8 s" in error["detail"]
    assert 0.7 < held < 10.0  # the deadline, not the socket's 30 s or never
    assert app.cuts == ["requests_body_timeout"]
    assert app.seen == ["ClientDisconnect" if path == "/asgi" else "http.disconnect"]


def test_a_body_trickling_below_the_minimum_rate_is_cut_before_the_whole_deadline() -> None:
    slow = ReadDeadlines(head_seconds=5, body_seconds=30, body_min_rate=100, body_rate_grace=0.5)
    app = Guarded(slow)
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_head("/asgi", 1000))
        started, sent = time.monotonic(), 0
        try:
            while time.monotonic() - started < 10:  # one byte every 0.1 s: 10 bytes/s
                sock.sendall(b"x")
                sent += 1
                time.sleep(0.1)
        except OSError:  # the server closed the connection
            pass
        answer, closed = _read_all(sock)
    status, error, closes = _error(answer)
    held = closed - started
    print(f"10 bytes/s against a 100 bytes/s minimum: cut after {held:.2f} s, {sent} bytes")
    assert (status, error["error"], closes) == (408, "body_timeout", True)
    assert "slower than 100 bytes/s" in error["detail"]
    assert held < 15  # the rate cut it: the whole deadline (30 s) never came into it
    assert app.cuts == ["requests_body_timeout"]


@pytest.mark.slow
def test_a_body_at_the_minimum_rate_or_better_is_read_whole() -> None:
    # 20 times the minimum rate: a loaded machine stretching every 0.1 s sleep to 1 s still
    # sends twice the minimum
    slow = ReadDeadlines(head_seconds=5, body_seconds=120, body_min_rate=20, body_rate_grace=0.5)
    app = Guarded(slow)
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_head("/direct", 800))
        for _ in range(20):  # 40 bytes every 0.1 s: 400 bytes/s for 2 s
            sock.sendall(b"x" * 40)
            time.sleep(0.1)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"length":800}')
    assert app.cuts == [] and app.seen == ["body 800"]


def test_half_a_head_is_a_408_and_a_silent_connection_is_closed() -> None:
    app = Guarded()
    with served(app) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /asgi HTTP/1.1\r\nHost: x\r\nContent-Le")
            started = time.monotonic()
            answer, closed = _read_all(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
            idle_started = time.monotonic()
            nothing, idle_closed = _read_all(idle)
    status, error, closes = _error(answer)
    assert (status, error["error"], closes) == (408, "head_timeout", True)
    assert 0.5 < closed - started < 10.0  # the 0.6 s deadline, not the socket's 30 s
    assert nothing == b"" and 0.5 < idle_closed - idle_started < 10.0
    assert app.cuts == ["requests_head_timeout"] * 2


def test_bare_crlfs_do_not_keep_a_connection_open() -> None:
    app = Guarded()
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        try:
            for _ in range(200):  # 20 s of CRLFs unless the server closes first
                sock.sendall(b"\r\n")
                time.sleep(0.1)
        except OSError:
            pass
        _, closed = _read_all(sock)
    assert closed - started < 10.0  # the 0.6 s head deadline, not the 20 s of CRLFs


def test_time_the_server_holds_a_body_back_does_not_count() -> None:
    """``Expect: 100-continue``: the client sends its body only once the handler asks for it,
    1.5 s after the head, past the 0.8 s body deadline, and is answered in full."""
    app = Guarded()
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_head("/late", 4, b"Expect: 100-continue"))
        interim = sock.recv(65536)
        sock.sendall(b"abcd")
        answer = sock.recv(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"length":4}')
    assert app.cuts == []


def test_a_connection_kept_alive_serves_requests_that_arrive_in_time() -> None:
    app = Guarded()
    with served(app) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for _ in range(3):
            sock.sendall(_head("/direct", 3) + b"abc")
            assert sock.recv(65536).endswith(b'{"length":3}')
            time.sleep(0.5)  # idle, under the keep-alive: no head is arriving
    assert app.cuts == []


def test_deadline_settings_are_validated() -> None:
    defaults = DeadlineSettings().read_deadlines()
    assert defaults == ReadDeadlines()
    assert (defaults.head_seconds, defaults.body_seconds) == (10.0, 60.0)
    with pytest.raises(ValidationError, match="body_rate_grace_seconds"):
        DeadlineSettings(body_timeout_seconds=5, body_rate_grace_seconds=5)
    with pytest.raises(ValidationError, match="greater than 0"):
        DeadlineSettings(body_timeout_seconds=0)
    rate_off = DeadlineSettings(
        body_timeout_seconds=5, body_rate_grace_seconds=9, body_min_rate_bytes=0
    )
    assert rate_off.read_deadlines().body_min_rate == 0


def test_the_rate_rule() -> None:
    rule = ReadDeadlines(head_seconds=1, body_seconds=60, body_min_rate=1000, body_rate_grace=5)
    assert rule.body_late(4.9, 0) is None  # within the grace
    assert rule.body_late(7.0, 2000) is None  # owes 2000 after 2 s past the grace
    assert "slower than 1000 bytes/s" in str(rule.body_late(7.0, 1999))
    assert "within 60 s" in str(rule.body_late(60.0, 10**9))


def _pipelined(port: int, count: int) -> socket.socket:
    """A connection with ``count`` pipelined ``GET /big`` sent on it (a small receive buffer,
    so the server's writes pause soon once nothing is read)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * count)
    return sock


def _drained(sock: socket.socket) -> int:
    """Bytes read until the server closes or drops the connection."""
    read = 0
    try:
        while chunk := sock.recv(1 << 20):
            read += len(chunk)
    except ConnectionResetError:
        pass
    return read


def test_a_client_that_never_reads_its_answers_is_dropped_at_the_body_deadline() -> None:
    """200 pipelined ``GET /big`` (200 KB each), never read: the server's writes pause, and
    after the body deadline (0.8 s) without a read the connection is dropped and counted; an
    honest client reading its 20 answers gets every byte."""
    app = Guarded()
    with served(app) as port:
        with _pipelined(port, 200) as attacker:
            wait_until(lambda: "requests_write_timeout" in app.cuts, timeout=30, interval=0.05)
            got = _drained(attacker)
        with _pipelined(port, 20) as honest:
            control = b""
            while control.count(b"HTTP/1.1 200 ") < 20 or not control.endswith(b"x" * BIG):
                chunk = honest.recv(1 << 20)
                assert chunk, "the honest reader's connection was closed"
                control += chunk
    print(
        f"ATTACK slow reader: 200 pipelined GETs of {BIG} B never read: dropped "
        f"({app.cuts}), {got} of {200 * BIG} B sent; honest control read all 20 answers, "
        f"{len(control)} B"
    )
    assert app.cuts == ["requests_write_timeout"]
    assert got < 200 * BIG  # it was dropped, not served to the end
    assert control.count(b"x" * BIG) == 20  # every answer whole, nothing cut
