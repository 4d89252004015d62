"""The services' HTTP/1.1 server: uvicorn with a bounded request head and JSON protocol errors.

:class:`JsonHttpToolsProtocol` keeps uvicorn's httptools parser and, before any application code
runs, answers a request line plus headers over :data:`HEAD_LIMIT` bytes (a head still arriving
is cut off at :data:`RAW_HEAD_LIMIT`) with ``431 head_too_large``, and a request the parser
refuses with ``400 malformed_http``: JSON ``{"error", "detail"}`` (:mod:`runtime.http`,
:data:`runtime.http.SERVER_STATUSES`), connection closed. :class:`OneWriteResponse` sends a
response's head with its first body bytes, so a killed process never leaves a bare head that a
proxy cannot resend. An app may name direct routes (:class:`DirectRoutes`): their requests skip
the ASGI cycle and are answered in one write. Serve with
``uvicorn.run(app, **uvicorn_options())``.

Why: docs/architecture.md, "Runtime: HAProxy and the server".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol, cast

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from runtime.http import INTERNAL_DETAIL, error_body

#: Largest request head (request line and headers, in bytes) a service accepts.
HEAD_LIMIT = 32 * 1024
#: Bytes of a request head still being received before the connection is refused anyway (a
#: single endless header never reaches the parsed-size check).
RAW_HEAD_LIMIT = 2 * HEAD_LIMIT


Headers = list[tuple[bytes, bytes]]
#: A direct route's answer: (status, JSON body, extra response headers).
Answer = tuple[int, bytes, Headers]
#: A direct route: the request's headers (lower-case names) and uvicorn's ``receive``, to its
#: answer. It answers every failure itself (a refusal, or a 500 for a bug).
DirectHandler = Callable[[Headers, Callable[[], Awaitable[Any]]], Awaitable[Answer]]
#: How far :func:`direct_routes` looks through middleware (``.app``) for an app's routes.
WRAPPERS = 4


class DirectRoutes(Protocol):
    """An ASGI app with routes answered without the ASGI cycle (:class:`JsonHttpToolsProtocol`):
    middleware wrapped around the app, uvicorn's proxy-headers one included, is skipped for
    them, so a direct route must not need what middleware adds (the client's address)."""

    def direct_route(self, method: str, path: str) -> DirectHandler | None:
        """The handler for ``method path``, or None to serve it through ASGI."""


def direct_routes(app: Any) -> DirectRoutes | None:
    """The first app with direct routes among ``app`` and what it wraps (uvicorn wraps the
    served app in middleware such as its proxy-headers one)."""
    for _ in range(WRAPPERS):
        if hasattr(app, "direct_route"):
            return cast(DirectRoutes, app)
        app = getattr(app, "app", None)
    return None


class HeadTooLargeError(Exception):
    """The request head is over :data:`HEAD_LIMIT` (raised inside a parser callback)."""


#: uvicorn's interim answer to ``Expect: 100-continue``.
CONTINUE = b"HTTP/1.1 100 "


class OneWriteResponse:
    """The transport one response is written through: its first write (the head) is held
    until the next (its first body bytes) and sent with it, or at the next turn of the event
    loop if no body follows at once (a bodiless answer); everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._started = False

    def write(self, data: bytes) -> None:
        if data.startswith(CONTINUE):  # an interim answer before the request body: as is
            self._transport.write(data)
            return
        if not self._started:
            self._started, self._head = True, data
            self._loop.call_soon(self._flush)
            return
        if self._head is not None:
            data, self._head = self._head + data, None
        self._transport.write(data)

    def _flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        """Send a held head (a bodiless answer: HEAD, 204, 304) before closing."""
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Send a held head before ending the stream."""
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class JsonHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request-head limit and JSON protocol errors."""

    head_limit: ClassVar[int] = HEAD_LIMIT
    raw_head_limit: ClassVar[int] = RAW_HEAD_LIMIT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0  # parsed request line and headers of the current request
        self._raw_head_bytes = 0  # bytes received while the current head is incomplete
        self._direct = direct_routes(self.app)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # uvicorn's own handling (no upgrade is served)
                self.handle_websocket_upgrade()
            else:
                self._end_after_this_request()
            return
        except httptools.HttpParserError:
            if self._head_bytes > self.head_limit:  # raised by _grow inside a callback
                self._refuse(431, "head_too_large", self._too_large())
            else:
                self.logger.warning("invalid HTTP request received")
                self._refuse(400, "malformed_http", "the request is not valid HTTP/1.1")
            return
        if self._in_head:
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > self.raw_head_limit:
                self._refuse(431, "head_too_large", self._too_large())

    def _end_after_this_request(self) -> None:
        """An upgrade request (``Connection: upgrade`` with ``Upgrade``), served as an
        ordinary one without its body: the parser drops the rest of the read its head came
        in, so the connection ends with its answer (``connection: close``) rather than
        reading what follows out of step; a client sees anything it pipelined behind it
        unanswered on a closed connection, and sends it again."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # always so: its head was parsed in this read
        else:  # a guard: no answer is left to carry the close
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's own 400 (kept for any path that still calls it), as JSON."""
        self._refuse(400, "malformed_http", "the request is not valid HTTP/1.1")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._raw_head_bytes = False, 0
        super().on_headers_complete()
        if self.cycle is not None:
            writes = OneWriteResponse(self.transport, self.loop)
            self.cycle.transport = cast(asyncio.Transport, writes)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """Start a request (now, or once the pipelined ones before it are answered): through
        the app's direct route for it if it has one, else through ASGI."""
        handler = None
        if self._direct is not None and app is self.app:  # not uvicorn's own 503 app
            handler = self._direct.direct_route(cycle.scope["method"], cycle.scope["path"])
        if handler is None:
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(self._answer_directly(cycle, handler))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _answer_directly(self, cycle: RequestResponseCycle, handler: DirectHandler) -> None:
        """A direct route's request: the handler's answer, or for anything raised out of it
        (a bug, or the task cancelled at shutdown) the JSON 500 with the connection closed,
        as uvicorn's ``run_asgi`` answers an app that raised."""
        try:
            answer = await handler(cast(Headers, cycle.scope["headers"]), cycle.receive)
        except (Exception, asyncio.CancelledError):
            self.logger.exception("Exception in a direct route")
            answer = (500, error_body("internal", INTERNAL_DETAIL), [])
            cycle.keep_alive = False
        finally:
            on_response, cycle.on_response = cycle.on_response, lambda: None
        if self.flow.write_paused and not cycle.disconnected:
            await self.flow.drain()
        # connection_lost marks only the newest request's cycle: one pipelined behind this
        # one leaves this cycle unmarked, and uvloop refuses a write to a closed transport.
        if cycle.disconnected or self.transport.is_closing():
            return
        self._write_answer(cycle, *answer)
        on_response()

    def _write_answer(
        self, cycle: RequestResponseCycle, status: int, body: bytes, extra: Headers
    ) -> None:
        """What uvicorn's ``send`` would write for a JSON answer (status line, default
        headers, content type and length, the extra headers, ``connection: close`` when the
        connection ends, the body), in one write, and the cycle ended as ``send`` ends it:
        the same wire answer without the ASGI middleware and two ``send`` calls with their
        header checks."""
        if cycle.waiting_for_100_continue:  # refused before the body was asked for: the
            cycle.keep_alive = False  # client may send it or not, so nothing after is a request
        self.transport.write(self._json_answer(status, body, extra, close=not cycle.keep_alive))
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()

    def _grow(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.head_limit:
            raise HeadTooLargeError

    def _too_large(self) -> str:
        return f"request line and headers exceed {self.head_limit} bytes"

    def _refuse(self, status: int, code: str, detail: str) -> None:
        """Answer ``status`` with the JSON error shape and close the connection."""
        if self.transport.is_closing():
            return
        self.transport.write(self._json_answer(status, error_body(code, detail), [], close=True))
        self.transport.close()

    def _json_answer(self, status: int, body: bytes, extra: Headers, close: bool) -> bytes:
        """A whole JSON answer as uvicorn's ``send`` would write it: status line, the server's
        default headers, content type and length, ``extra``, ``connection: close`` if
        ``close``, the body."""
        lines = [*self.server_state.default_headers, (b"content-type", b"application/json")]
        lines += [*extra, (b"content-length", b"%d" % len(body))]
        if close:
            lines.append((b"connection", b"close"))
        head = b"".join(name + b": " + value + b"\r\n" for name, value in lines)
        return b"".join([STATUS_LINE[status], head, b"\r\n", body])


def uvicorn_options() -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` that every service uses: the protocol above, no
    WebSocket support (nothing is served over it, and uvicorn would refuse an upgrade with a
    bodiless 403: without it an upgrade request is an ordinary request, answered in JSON), and
    the same head limit for h11 should anyone select it instead."""
    return {
        "http": JsonHttpToolsProtocol,
        "ws": "none",
        "h11_max_incomplete_event_size": HEAD_LIMIT,
    }
