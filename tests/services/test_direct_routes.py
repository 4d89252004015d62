"""A route an app answers directly (runtime/server.py, ``direct_route``: the shuffler's
``POST /v1/contributions``) must look on the wire like one answered through ASGI: same head,
keep-alive and pipelining, ``connection: close`` honoured, ``Expect: 100-continue`` answered,
a bug answered with the JSON 500; every other method and path still goes through ASGI."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from runtime.http import INTERNAL_DETAIL
from runtime.server import Answer, DirectHandler, Headers

from ..support import exchange, served


class Echo:
    """``POST /echo`` answered directly with the body's length, ``POST /slow`` the same a
    moment later, ``POST /boom`` raises; ``POST /asgi`` answers like ``/echo`` through ASGI
    (FastAPI), for comparison, and so does ``GET /echo``, which is not a direct route;
    ``POST /no`` refuses without reading the body."""

    def __init__(self) -> None:
        self.app = FastAPI()

        @self.app.post("/asgi")
        async def asgi(request: Request) -> Response:
            body = await request.body()
            content = b'{"length":%d}' % len(body)
            headers = {"x-route": "direct"}
            return Response(content, 200, headers, media_type="application/json")

        @self.app.get("/echo")
        async def get() -> dict[str, str]:
            return {"through": "asgi"}

    def direct_route(self, method: str, path: str) -> DirectHandler | None:
        """The handler of a direct route, None for everything else (served through ASGI)."""
        routes = {"/echo": self.echo, "/slow": self.slow, "/boom": self.boom, "/no": self.no}
        return routes.get(path) if method == "POST" else None

    async def echo(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        """The body's length, as JSON."""
        message = await receive()
        return 200, b'{"length":%d}' % len(message["body"]), [(b"x-route", b"direct")]

    async def slow(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        """:meth:`echo`, answered after the client has had time to go away."""
        answer = await self.echo(headers, receive)
        await asyncio.sleep(0.3)
        return answer

    async def no(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        """A refusal before the body is read."""
        return 401, b'{"error":"bad_token","detail":"no"}', []

    async def boom(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        """A bug."""
        raise RuntimeError("a bug")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def _post(path: str, body: bytes, *extra: bytes) -> bytes:
    """A raw HTTP/1.1 ``POST`` of ``body`` with the ``extra`` header lines."""
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: x", *extra]
    head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _head_and_body(answer: bytes) -> tuple[list[bytes], bytes]:
    """The answer's head lines but its date, sorted, and its body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = [line.lower() for line in head.split(b"\r\n") if not line.startswith(b"date:")]
    return sorted(lines), body


def test_a_direct_answer_is_the_answer_asgi_gives() -> None:
    with served(Echo()) as port:
        direct = exchange(port, _post("/echo", b"abc"))
        through_asgi = exchange(port, _post("/asgi", b"abc"))
    assert _head_and_body(direct) == _head_and_body(through_asgi)
    assert direct.startswith(b"HTTP/1.1 200 OK\r\n") and direct.endswith(b'{"length":3}')


def test_direct_and_asgi_requests_pipelined_on_one_connection_are_answered_in_order() -> None:
    requests = [_post("/echo", b"a"), b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", _post("/echo", b"")]
    with served(Echo()) as port:
        answer = exchange(port, b"".join(requests), answers=3)
    bodies = [part.partition(b"\r\n\r\n")[2] for part in answer.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b'{"length":1}', b'{"through":"asgi"}', b'{"length":0}']


def test_connection_close_is_honoured_and_100_continue_answered() -> None:
    with served(Echo()) as port:
        closing = exchange(port, _post("/echo", b"ab", b"Connection: close"), answers=2)
        waiting = exchange(port, _post("/echo", b"abcd", b"Expect: 100-continue"), answers=2)
    assert closing.count(b"HTTP/1.1 ") == 1  # the server closed: no second answer awaited
    assert b"\r\nconnection: close\r\n" in closing and closing.endswith(b'{"length":2}')
    assert waiting.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert waiting.endswith(b'{"length":4}')


def test_a_bug_in_a_direct_route_is_the_json_500_and_closes_the_connection() -> None:
    with served(Echo()) as port:
        answer = exchange(port, _post("/boom", b"x"), answers=2)
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert b"\r\nconnection: close\r\n" in answer
    assert answer.endswith(b'{"error":"internal","detail":"%s"}' % INTERNAL_DETAIL.encode())


def test_a_client_gone_before_a_pipelined_direct_answer_leaves_no_failed_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client sends a slow direct request with another pipelined behind it, then goes
    away: the server notices that the connection closed (it marks only the newest request
    as disconnected) and writes nothing, instead of failing the task on a closed transport,
    and it goes on serving."""
    caplog.set_level(logging.ERROR)
    with served(Echo()) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(_post("/slow", b"ab") + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.1)  # both requests parsed; the first still being answered
        time.sleep(0.5)  # past the slow answer
        gc.collect()  # a failed task's exception is reported when the task is collected
        assert exchange(port, _post("/echo", b"abc")).endswith(b'{"length":3}')
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_refusal_before_a_100_continue_body_was_asked_for_closes_the_connection() -> None:
    """The client was told neither to send its body nor not to: whatever it sends next may
    be that body, so the refusal ends the connection instead of reading it as a request."""
    with served(Echo()) as port:
        answer = exchange(port, _post("/no", b"abcd", b"Expect: 100-continue"), answers=2)
    assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n")  # no 100 Continue first
    assert b"\r\nconnection: close\r\n" in answer and answer.count(b"HTTP/1.1 ") == 1


def test_an_upgrade_request_is_answered_and_ends_the_connection() -> None:
    """No upgrade is served: such a request is an ordinary one, but the parser reads nothing
    after its head, so its answer closes the connection (what was pipelined behind it is left
    for the client to send again) instead of leaving the connection hanging."""
    upgrade = b"Connection: Upgrade\r\nUpgrade: h2c\r\n"
    then = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
    with served(Echo()) as port:
        direct = exchange(port, _post("/echo", b"", upgrade.strip()) + then, answers=2)
        asgi = exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n" + then, 2)
    for answer, body in ((direct, b'{"length":0}'), (asgi, b'{"through":"asgi"}')):
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.count(b"HTTP/1.1 ") == 1
        assert b"\r\nconnection: close\r\n" in answer and answer.endswith(body)
