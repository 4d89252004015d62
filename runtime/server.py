"""The services' HTTP/1.1 server: uvicorn with a bounded request head and JSON protocol errors.

:class:`JsonHttpToolsProtocol` keeps uvicorn's httptools parser and, before any application code
runs, answers a request line plus headers over :data:`HEAD_LIMIT` bytes (a head still arriving
is cut off at :data:`RAW_HEAD_LIMIT`) with ``431 head_too_large``, and a request the parser
refuses with ``400 malformed_http``: JSON ``{"error", "detail"}`` (:mod:`runtime.http`,
:data:`runtime.http.SERVER_STATUSES`), connection closed. :class:`OneWriteResponse` sends a
response's head with its first body bytes, so a killed process never leaves a bare head that a
proxy cannot resend. An app may name direct routes (:class:`DirectRoutes`): their requests skip
the ASGI cycle and are answered in one write. Serve with
``uvicorn.run(app, **uvicorn_options())``. The protocol subclasses uvicorn's private httptools
one, so uvicorn is pinned to the tested releases, :data:`runtime.uvicorn_api.SUPPORTED`.

Every request is held to the application's :class:`runtime.deadlines.ReadDeadlines` (given as
``app.state.read_guard``, :class:`runtime.deadlines.ReadGuard`; defaults otherwise): a head
not whole within its deadline is answered ``408 head_timeout``, a body not whole within its
deadline or arriving below the minimum rate ``408 body_timeout``, the connection closed and
the application's reads of it ended (a handler waiting for the body sees the client gone). A
client that stops reading its answers (writes paused: the transport's buffer is full) for the
body deadline is dropped (``requests_write_timeout``), so a slow reader with requests pipelined
behind cannot hold a connection either. So no client holds a connection, or what the
application reserved for its request, for longer. A connection idle after an answer is closed
after :data:`KEEP_ALIVE_SECONDS`.

Why: docs/architecture.md, "Runtime: HAProxy and the server".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol, cast

import httptools

from runtime import uvicorn_api
from runtime.deadlines import ReadGuard
from runtime.http import INTERNAL_DETAIL, error_body

try:  # uvicorn's private API (runtime.uvicorn_api): on an untested release, say what is missing
    from uvicorn.protocols.http.httptools_impl import (
        STATUS_LINE,
        HttpToolsProtocol,
        RequestResponseCycle,
    )
except ImportError as error:
    raise ImportError(uvicorn_api.explain(uvicorn_api.missing())) from error

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
#: Seconds an idle connection is kept open after an answer (uvicorn's ``timeout_keep_alive``;
#: bytes that start no request, such as bare CRLFs, do not keep it open: they are a head).
KEEP_ALIVE_SECONDS = 5
#: Longest wait between two looks at a request that is still arriving (shorter for short
#: deadlines: a quarter of the deadline).
WATCH_SECONDS = 1.0
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


def read_guard(app: Any) -> ReadGuard:
    """The deadlines and counter the application gives (``app.state.read_guard``) among
    ``app`` and what it wraps, or the defaults."""
    for _ in range(WRAPPERS):
        guard = getattr(getattr(app, "state", None), "read_guard", None)
        if isinstance(guard, ReadGuard):
            return guard
        app = getattr(app, "app", None)
    return ReadGuard()


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
        guard = read_guard(self.app)
        self._deadlines, self._count_cut = guard.deadlines, guard.count
        self._phase: str | None = None  # "head" or "body" while a request is arriving
        self._phase_used = 0.0  # seconds of the phase counted against its deadline
        self._phase_mark = 0.0  # when _phase_used was last brought up to date (loop time)
        self._body_bytes = 0  # body bytes of the current request so far
        self._watch: asyncio.TimerHandle | None = None
        self._write_watch: asyncio.TimerHandle | None = None  # set while writes are paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin("head")  # a connection that never sends a head is closed too
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        for watch in (self._watch, self._write_watch):
            if watch is not None:
                watch.cancel()
        self._watch = self._write_watch = None
        self._phase = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client stopped reading what is written to it (the transport's buffer is over
        its high-water mark): it has ``body_seconds`` to read again before the connection is
        dropped (:meth:`_write_late`)."""
        super().pause_writing()
        if self._write_watch is None:
            limit = self._deadlines.body_seconds
            self._write_watch = self.loop.call_later(limit, self._write_late)

    def resume_writing(self) -> None:
        """The client read enough again: the write deadline starts over at the next pause."""
        super().resume_writing()
        if self._write_watch is not None:
            self._write_watch.cancel()
            self._write_watch = None

    def _write_late(self) -> None:
        """A client that read nothing for ``body_seconds`` while answers waited for it (a slow
        reader, perhaps with requests pipelined behind): counted as ``requests_write_timeout``
        and the connection dropped at once (a close would wait for the unread bytes forever),
        which ends every answer's wait on it."""
        self._write_watch = None
        self._count_cut("requests_write_timeout")
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._phase is None:  # bytes after an answer: the next head's clock starts
            self._begin("head")
        self._feed(data)
        if self._phase is not None and self._watch is None and not self.transport.is_closing():
            self._arm()  # only a request still arriving after this read is watched

    def _feed(self, data: bytes) -> None:
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
        if self._phase != "head":  # bytes before it (bare CRLFs) already count
            self._begin("head")

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
        self._begin("body")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = None
        super().on_message_complete()

    def _begin(self, phase: str) -> None:
        """Start the clock of a request's head or body."""
        self._phase, self._phase_used, self._body_bytes = phase, 0.0, 0
        self._phase_mark = self.loop.time()

    def _arm(self) -> None:
        """Look at the arriving request again in a while (a quarter of its deadline, at most
        :data:`WATCH_SECONDS`, so a deadline is overrun by at most that)."""
        deadlines = self._deadlines
        limit = deadlines.head_seconds if self._phase == "head" else deadlines.body_seconds
        self._watch = self.loop.call_later(min(WATCH_SECONDS, limit / 4), self._look)

    def _look(self) -> None:
        """Count the time since the last look against the arriving request's deadline (unless
        the server held it back meanwhile) and cut the request off if it is late."""
        self._watch = None
        if self._phase is None or self.transport.is_closing():
            return
        now = self.loop.time()
        if not self._held_back():
            self._phase_used += now - self._phase_mark
        self._phase_mark = now
        late = self._late()
        if late is None:
            self._arm()
        else:
            self._cut(*late)

    def _held_back(self) -> bool:
        """Whether the server, not the sender, is why the request is not arriving: an earlier
        request on the connection is still being answered (for a head), or (for a body) the
        server paused reading until the application asks for more, or has not answered an
        ``Expect: 100-continue`` yet."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return False
        if self._phase == "head":
            return True
        return cycle.waiting_for_100_continue or self.flow.read_paused

    def _late(self) -> tuple[str, str] | None:
        """(code, detail) if the arriving request is over its deadline, else None."""
        if self._phase == "head":
            limit = self._deadlines.head_seconds
            if self._phase_used < limit:
                return None
            return "head_timeout", f"the request head did not arrive within {limit:g} s"
        why = self._deadlines.body_late(self._phase_used, self._body_bytes)
        return None if why is None else ("body_timeout", why)

    def _cut(self, code: str, detail: str) -> None:
        """End a late request: ``408 code`` if it can still be answered (a head that began,
        a body whose application has not answered yet), the application's reads of it ended
        (it sees the client gone, so whatever it holds for the request is let go), the
        connection closed."""
        self._count_cut(f"requests_{code}")
        self._phase = None
        cycle = self.cycle
        if code == "head_timeout":
            answer = self._in_head and self._raw_head_bytes > 0
        else:
            answer = cycle is not None and not cycle.response_started
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # receive() answers http.disconnect, send() nothing
                cycle.message_event.set()
        if answer:
            self._refuse(408, code, detail)
        else:
            self.transport.close()

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
    bodiless 403: without it an upgrade request is an ordinary request, answered in JSON), the
    same head limit for h11 should anyone select it instead, and the idle keep-alive
    :data:`KEEP_ALIVE_SECONDS`. Raises RuntimeError naming what is missing if the installed
    uvicorn lacks the private API the protocol builds on (:func:`runtime.uvicorn_api.require`)."""
    uvicorn_api.require()
    return {
        "http": JsonHttpToolsProtocol,
        "ws": "none",
        "h11_max_incomplete_event_size": HEAD_LIMIT,
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
    }
