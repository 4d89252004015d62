"""``POST /v1/contributions`` outside FastAPI, with group commit (docs/protocol.md: ``202`` only
after the contribution's transaction committed).

Profiling showed FastAPI's per-request machinery (middleware, exception wrappers, dependency
solving) costing more than the ingest work itself, so this one route skips it: the services'
HTTP server calls :class:`Ingest` directly (:meth:`IngestFastPath.direct_route`), and any
other ASGI server reaches it through :class:`IngestFastPath` as a raw ASGI route. It keeps the
same error contract as every other route: refusals are :class:`~shuffler.errors.ShufflerError`
answered through :func:`runtime.http.error_body` and
:func:`~runtime.http.status_of`.

Concurrent requests are committed together by one writer thread (:class:`CommitQueue`), so
durability costs one sync per batch of requests rather than per request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import Any

from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError

from runtime.cors import Handler
from runtime.http import INTERNAL_DETAIL, STORAGE_RETRY_SECONDS, error_body, status_of
from shuffler.errors import (
    BadContentTypeError,
    BadTokenError,
    BodyTooLargeError,
    KeyNotLoadedError,
    MalformedContributionError,
    ShufflerError,
    ShufflerStorageError,
)
from shuffler.records import Pending
from shuffler.service import ShufflerService, Stored

log = logging.getLogger("esa.shuffler")
ROUTE = "/v1/contributions"
CONTENT_TYPE = b"application/octet-stream"
JSON_HEADERS = (b"content-type", b"application/json")
Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, bytes, Headers]
Item = tuple[Pending, "asyncio.Future[Stored]"]
#: How many recent takes the commit window learns the batch size to wait for from, and for
#: how long it remembers them across an idle writer (a client probing the window's delay
#: must not learn the size of a burst from long ago).
RECENT = 16
RECENT_SECONDS = 1.0


class CommitQueue:
    """Group commit: one dedicated writer thread stores queued contributions in shared
    transactions (up to ``max_batch`` each) and resolves their futures on the event loop.

    Nothing is acknowledged before its commit; a failed commit stores nothing and refuses every
    request of the batch (503). Under load a batch may wait up to ``wait`` seconds for the
    requests that usually come with it (:meth:`_take`), so the number of transactions follows
    the load, not the scheduler; a request on an idle service is committed at once. Design and
    costs: docs/shuffler.md, "Group commit".
    """

    def __init__(
        self, service: ShufflerService, max_batch: int, fill: int = 1, wait: float = 0.0
    ) -> None:
        self.service = service
        self.max_batch = max_batch
        self.fill, self.wait = min(fill, max_batch), wait
        self._busy = False  # the previous batch held more than one request
        self._filled = threading.Event()  # set by _put once a batch of ``fill`` is queued
        self._stopping = False
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT)
        self._want = 1  # the batch size the writer waits for (see _take)
        self._ended = 0.0  # when the last commit ended (monotonic)
        self._inbox: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the writer thread (from the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="esa-commit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the writer thread (blocking)."""
        if self._thread is not None:
            self._put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, pending: Pending) -> asyncio.Future[Stored]:
        """Queue one contribution; the future resolves after its transaction ended."""
        if self._loop is None:
            raise RuntimeError("the commit queue is not running")
        future: asyncio.Future[Stored] = self._loop.create_future()
        self._put((pending, future))
        return future

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items, stopping = self._take()
            if not items:
                return
            results = self._commit([pending for pending, _ in items])
            self._ended = time.monotonic()
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_resolve, items, results)
            except RuntimeError:  # the loop is gone (shutdown): nobody is waiting any more
                return

    def _take(self) -> tuple[list[Item], bool]:
        """Block for one item, then take what else is queued: (items, stop after these).

        Under load (the previous batch held several requests and ended less than ``wait``
        ago) first wait, up to ``wait``, until as many are queued as in the largest of the
        last :data:`RECENT` batches (at most ``fill``): clients that keep c requests in flight
        make batches of c at most, so they wait for those c only, never for a fill that
        cannot come. :meth:`_put` wakes the writer once the batch is there, not at every
        arrival."""
        first = self._inbox.get()
        if first is None:
            return [], True
        if time.monotonic() - self._ended > RECENT_SECONDS:
            self._recent.clear()  # idle since: what earlier batches held is not kept
        self._want = min(self.fill, max(self._recent, default=1))
        if self._busy and time.monotonic() - self._ended < self.wait:
            self._filled.clear()
            if not self._full_or_stopping():  # nothing arrived between the check and the clear
                self._filled.wait(self.wait)
        items = [first]
        while len(items) < self.max_batch:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        self._busy = len(items) > 1
        self._recent.append(len(items))
        return items, False

    def _full_or_stopping(self) -> bool:
        """Whether to commit without waiting: the batch the writer waits for is queued, or
        stop() was called."""
        return self._stopping or self._inbox.qsize() + 1 >= self._want

    def _put(self, item: Item | None) -> None:
        """Queue an item (``None``: stop), waking a writer that waits to fill its batch once
        the batch is there."""
        self._stopping = self._stopping or item is None
        self._inbox.put(item)
        # Only a cleared event needs setting: the writer clears it before it checks the queue,
        # so an item put while it was still set is seen by that check.
        if not self._filled.is_set() and self._full_or_stopping():
            self._filled.set()

    def _commit(self, pending: list[Pending]) -> list[Stored]:
        try:
            return self.service.commit(pending)
        except Exception as failure:  # the transaction rolled back: nothing was stored
            # Only the type: messages and tracebacks of database errors carry the parameters.
            message = (
                "storage unavailable" if isinstance(failure, SQLAlchemyError) else "commit failed"
            )
            log.error(message, extra={"error": type(failure).__name__})
            refused = ShufflerStorageError(
                "the database did not commit; nothing was stored",
                retry_after=STORAGE_RETRY_SECONDS,
            )
            return [Stored(None, refused)] * len(pending)


def _resolve(items: list[Item], results: list[Stored]) -> None:
    for (_, future), result in zip(items, results, strict=True):
        if not future.done():  # a request whose client went away was cancelled
            future.set_result(result)


async def read_body(receive: Any, limit: int) -> bytes:
    """The request body, refused as soon as it exceeds ``limit`` bytes or if the connection
    closes before it ended (a body cut short is not a contribution, even when what arrived
    happens to open).

    Raises:
        BodyTooLargeError: over ``limit``.
        MalformedContributionError: the client went away mid-body.
    """
    message = await receive()
    body = _chunk(message)
    if message.get("more_body", False):
        buffer = bytearray(body)
        while len(buffer) <= limit:
            message = await receive()
            buffer += _chunk(message)
            if not message.get("more_body", False):
                break
        body = bytes(buffer)
    if len(body) > limit:
        raise BodyTooLargeError(f"body exceeds {limit} bytes")
    return body


def _chunk(message: dict[str, Any]) -> bytes:
    """The body bytes of one ASGI ``receive`` message.

    Raises:
        MalformedContributionError: ``http.disconnect``: the body never ended.
    """
    if message["type"] != "http.request":
        raise MalformedContributionError("the connection closed before the body ended")
    chunk: bytes = message.get("body", b"")
    return chunk


def refused(error: ShufflerError) -> Answer:
    """A refusal as (status, JSON body, extra headers): the one error contract."""
    extra = []
    if error.retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
    return status_of(error), error_body(error.code, error.detail), extra


class Ingest:
    """One contribution from request headers and body to (status, JSON body, extra headers)."""

    def __init__(self, service: ShufflerService, writer: CommitQueue) -> None:
        self.service = service
        self.writer = writer
        self.max_body = service.settings.max_body_bytes

    async def __call__(self, raw_headers: Headers, receive: Any) -> Answer:
        try:
            headers = dict(raw_headers)  # a repeated name keeps its last value: count them
            repeated = len(headers) < len(raw_headers)
            if repeated and sum(name == b"authorization" for name, _ in raw_headers) > 1:
                raise BadTokenError("send one Authorization header")
            receipt = await self._accept(headers, receive)
        except ShufflerError as error:
            self.service.events.count(f"rejected_{error.code}")
            return refused(error)
        except Exception:  # a bug, not a refusal: logged, answered like every other 500
            log.exception("unexpected error", extra={"route": ROUTE})
            return 500, error_body("internal", INTERNAL_DETAIL), []
        self.service.events.count("contributions_received")
        return 202, b'{"receipt":"%s"}' % receipt.encode(), []  # hex digits: nothing to escape

    async def _accept(self, headers: dict[bytes, bytes], receive: Any) -> str:
        """Authenticate, rate-limit, read, validate and commit; the receipt.

        Raises:
            ShufflerError: every refusal of docs/protocol.md, "Contributions".
        """
        authorization = headers.get(b"authorization", b"")
        if not authorization.startswith(b"Bearer "):
            raise BadTokenError("Authorization: Bearer <client token> required")
        service = self.service
        # Exactly "Bearer <token>": a load balancer hashes the header as sent to pick the
        # replica, so padding it must not reach another replica's rate-limit bucket.
        client_id = service.admit(authorization[7:].decode("latin-1"))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            raise BodyTooLargeError(f"body of {int(declared)} bytes > {self.max_body}")
        body = await read_body(receive, self.max_body)
        if headers.get(b"content-type", b"").split(b";")[0].strip().lower() != CONTENT_TYPE:
            raise BadContentTypeError("send the sealed contribution as application/octet-stream")
        try:
            pending = service.validate(client_id, body, catch_up=False)
        except KeyNotLoadedError:  # reading the key files blocks: not on the event loop
            pending = await asyncio.to_thread(service.catch_up, client_id, body)
        stored = await self.writer.submit(pending)
        if stored.refusal is not None:
            raise stored.refusal
        return str(stored.receipt)


class IngestFastPath:
    """ASGI front door: ``POST /v1/contributions`` to :class:`Ingest` (its CORS grant
    included), everything else (including lifespan, preflights, and other methods on that
    path: FastAPI's 405 with ``Allow``) to FastAPI, whose ``POST /v1/contributions`` route
    (:mod:`shuffler.routes`) is the same :class:`Ingest` and documents it."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def direct_route(self, method: str, path: str) -> Handler | None:
        """The app's :class:`Ingest` for ``POST /v1/contributions`` (with the CORS grant of
        :meth:`runtime.cors.Cors.direct` when a page origin is allowed: no middleware runs
        here), for the services' HTTP server to call without the ASGI cycle
        (:class:`runtime.server.JsonHttpToolsProtocol`, which serves nothing before the app's
        start); None for every other request."""
        if method != "POST" or path != ROUTE:
            return None
        return getattr(self.app.state, "direct_ingest", None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ingest = None
        if scope["type"] == "http":  # lifespan scopes have no method
            ingest = self.direct_route(scope["method"], scope["path"])
        if ingest is None:
            await self.app(scope, receive, send)
            return
        status, data, extra = await ingest(scope["headers"], receive)
        headers = [JSON_HEADERS, (b"content-length", str(len(data)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
