"""A response's head leaves in the same write as its first body bytes
(runtime/server.py): a process killed between two writes must never leave a head
without its body on the wire, which HAProxy cannot resend to another replica."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from runtime.server import OneWriteResponse

from ..support import exchange, served


class Recorded:
    """The writes a transport was given (what would go to the socket, one call each)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


def test_the_head_goes_out_with_the_first_body_bytes() -> None:
    loop = asyncio.new_event_loop()
    try:
        sent = Recorded()
        writes = OneWriteResponse(sent, loop)  # type: ignore[arg-type]
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert sent.writes == []
        writes.write(b"{}")
        writes.write(b"")
        assert sent.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b""]
        assert writes.is_closing() is False  # everything else is the transport's
    finally:
        loop.close()


def test_a_bodiless_head_still_leaves_on_the_next_turn_of_the_loop() -> None:
    async def answer() -> list[bytes]:
        sent = Recorded()
        writes = OneWriteResponse(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
        writes.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await asyncio.sleep(0)
        return sent.writes

    assert asyncio.run(answer()) == [b"HTTP/1.1 204 No Content\r\n\r\n"]


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/json")
    async def json() -> dict[str, Any]:
        return {"a": 1}

    @app.get("/empty")
    async def empty() -> Response:
        return Response(status_code=204)

    return app


def test_a_real_server_answers_whole_responses_and_bodiless_ones() -> None:
    with served(_app()) as port:
        both = b"GET /json HTTP/1.1\r\nHost: x\r\n\r\nGET /empty HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = exchange(port, both, answers=2)
    first, second = answer.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and first.endswith(b'{"a":1}')
    assert second.startswith(b"204")


def test_a_held_head_is_sent_before_the_connection_closes() -> None:
    """A bodiless answer on a closing connection (HEAD, HTTP/1.0): the head must not be lost
    to ``close``."""
    with served(_app()) as port:
        for request in (
            b"HEAD /json HTTP/1.0\r\n\r\n",
            b"HEAD /json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ):
            answer = exchange(port, request)
            assert answer.startswith((b"HTTP/1.1 405", b"HTTP/1.1 200")), answer
