"""A route an app answers directly (runtime/server.py, ``direct_route``: the shuffler's
``POST /v1/contributions``) must look on the wire like one answered through ASGI: same head,
keep-alive and pipelining, ``connection: close`` honoured, ``Expect: 100-continue`` answered,
a bug answered with the JSON 500; every other method and path still goes through ASGI."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from runtime.server import Answer, DirectHandler, Headers

from ..support import exchange, served


class Echo:
    """``POST /echo`` answered directly with the body's length; ``POST /boom`` raises;
    ``/echo`` through ASGI (FastAPI) answers the same JSON for comparison."""

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
        if method == "POST" and path == "/echo":
            return self.echo
        return self.boom if method == "POST" and path == "/boom" else None

    async def echo(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        message = await receive()
        return 200, b'{"length":%d}' % len(message["body"]), [(b"x-route", b"direct")]

    async def boom(self, headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
        raise RuntimeError("a bug")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def _post(path: str, body: bytes, *extra: bytes) -> bytes:
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
    assert answer.endswith(b'{"error":"internal","detail":"unexpected server error"}')
