"""The shuffler's HTTP API: a thin FastAPI layer over :class:`shuffler.core.ShufflerCore`.

Endpoints (PROTOCOL.md): ``POST /v1/enroll``, ``POST /v1/contributions`` (body: the sealed
contribution as ``application/octet-stream``), ``GET /v1/config``, ``GET /healthz``,
``GET /readyz``, ``GET /metrics``; plus admin ``POST /v1/admin/close`` and
``POST /v1/admin/revoke`` (bearer admin token). Every error is JSON ``{"error", "detail"}``.

``202`` is sent only after the contribution's transaction committed. Concurrent requests are
committed together by one writer task (group commit), so durability costs one sync per batch of
requests rather than per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel
from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError

from common.envelope import (
    KeyRing,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_identity,
)
from common.wire import EnrollResponse, ErrorBody
from services.runtime import db, logs
from services.runtime.http import (
    RejectedError,
    add_operational_routes,
    error,
    install_error_handlers,
)
from shuffler.core import Pending, ShufflerCore, Stored
from shuffler.settings import ShufflerSettings

log = logging.getLogger("esa.shuffler")
MIGRATIONS = Path(__file__).parent / "migrations"


def _error_json(code: str, detail: str) -> bytes:
    return json.dumps(ErrorBody(error=code, detail=detail).model_dump()).encode()


Ingest = Callable[[list[tuple[bytes, bytes]], Any], Awaitable[tuple[int, bytes, list[Any]]]]
JSON_HEADERS = (b"content-type", b"application/json")


class IngestFastPath:
    """ASGI front door and the only route for ``POST /v1/contributions``.

    Profiling showed FastAPI's per-request middleware (telemetry hooks, exception wrappers,
    dependency solving) costing more than the ingest work itself; the hot path skips it and
    produces the same responses. Everything else, including lifespan, goes to FastAPI.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/v1/contributions"
            or scope["method"] != "POST"
        ):
            await self.app(scope, receive, send)
            return
        ingest: Ingest = self.state.ingest
        status, data, extra = await ingest(scope["headers"], receive)
        headers = [JSON_HEADERS, (b"content-length", str(len(data)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Any, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if message.get("more_body", False):
        buffer = bytearray(body)
        while True:
            if len(buffer) > limit:
                break
            message = await receive()
            buffer += message.get("body", b"")
            if not message.get("more_body", False):
                break
        body = bytes(buffer)
    if len(body) > limit:
        raise RejectedError(413, "too_large", f"body exceeds {limit} bytes")
    return body


@dataclass
class TokenBucket:
    """Per-key token buckets; ``take`` returns 0 or the seconds until a token is free."""

    rate: float
    burst: float
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def take(self, key: str, now: float) -> float:
        tokens, last = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self.buckets[key] = (tokens - 1.0, now)
            return 0.0
        self.buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate


class CommitQueue:
    """Group commit: one dedicated writer thread stores queued contributions in shared
    transactions.

    The event loop hands each validated contribution over with a future and goes on serving
    other requests; the writer takes everything queued (up to ``max_batch``), commits it in one
    transaction (the database call and its sync run without the GIL), then resolves the whole
    batch's futures with one callback on the loop. Nothing is acknowledged before its commit;
    a failed commit stores nothing and answers every request of the batch with 503.
    """

    def __init__(self, core: ShufflerCore, max_batch: int) -> None:
        self.core = core
        self.max_batch = max_batch
        self._inbox: queue.SimpleQueue[tuple[Pending, asyncio.Future[Stored]] | None] = (
            queue.SimpleQueue()
        )
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
            self._inbox.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, pending: Pending) -> asyncio.Future[Stored]:
        """Queue one contribution; the future resolves after its transaction ended."""
        if self._loop is None:
            raise RuntimeError("the commit queue is not running")
        future: asyncio.Future[Stored] = self._loop.create_future()
        self._inbox.put((pending, future))
        return future

    def _run(self) -> None:
        inbox, stopping = self._inbox, False
        while not stopping:
            first = inbox.get()
            if first is None:
                return
            items = [first]
            while len(items) < self.max_batch:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                items.append(item)
            results = self._store([pending for pending, _ in items])
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_resolve, items, results)
            except RuntimeError:  # the loop is gone (shutdown): nobody is waiting any more
                return

    def _store(self, pending: list[Pending]) -> list[Stored]:
        try:
            return self.core.store(pending)
        except Exception as failure:  # the transaction rolled back: nothing was stored
            # Only the type: messages and tracebacks of database errors carry the parameters.
            message = (
                "storage unavailable" if isinstance(failure, SQLAlchemyError) else "commit failed"
            )
            log.error(message, extra={"error": type(failure).__name__})
            refused = RejectedError(
                503, "storage_unavailable", "the database did not commit; nothing was stored"
            )
            return [Stored(None, refused)] * len(pending)


def _resolve(items: list[tuple[Pending, asyncio.Future[Stored]]], results: list[Stored]) -> None:
    for (_, future), result in zip(items, results, strict=True):
        if not future.done():  # a request whose client went away was cancelled
            future.set_result(result)


class CoreCollector:
    """Prometheus metrics read from the core at scrape time (one source of truth)."""

    def __init__(self, core: ShufflerCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Any]:
        events = self.core.events
        counters = {
            "contributions_received": "contributions acknowledged (202)",
            "batches_released": "batches created by Algorithm 3",
            "batches_forwarded": "batches acknowledged by the analyzer",
            "batches_retried": "forwarding attempts that will be retried",
            "batches_failed": "batches the analyzer rejected permanently",
        }
        for name, help_text in counters.items():
            yield CounterMetricFamily(f"esa_shuffler_{name}", help_text, value=events.get(name, 0))
        rejected = CounterMetricFamily(
            "esa_shuffler_contributions_rejected", "refused", labels=["reason"]
        )
        for key, value in events.items():
            if key.startswith("rejected_"):
                rejected.add_metric([key.removeprefix("rejected_")], value)
        yield rejected
        deleted = CounterMetricFamily(
            "esa_shuffler_contributions_deleted", "deleted", labels=["cause"]
        )
        for cause in ("randomized_deletion", "abort", "retention"):
            deleted.add_metric([cause], events.get(f"deleted_by_{cause}", 0))
        yield deleted
        try:
            ledger = self.core.ledger()
        except SQLAlchemyError:
            return
        depth = GaugeMetricFamily(
            "esa_shuffler_queue_depth", "contributions by state", labels=["state"]
        )
        for state in ("pending", "held", "in_batches_unforwarded"):
            depth.add_metric([state], ledger[state])
        yield depth


WAL_AUTOCHECKPOINT_PAGES = 10_000


def _sqlite_checkpoint_interval(dbapi_connection: Any, _: Any) -> None:
    """Checkpoint the SQLite write-ahead log every 10,000 pages (~40 MB) instead of 1,000.

    Ingest touches random pages of the nonce and quota indexes; a checkpoint copies each page
    once however often it changed since the last one, so checkpointing less often writes far
    less. Durability is unchanged: a commit is on disk (in the log) when it returns.
    """
    dbapi_connection.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")


def _periodic(
    interval: float, work: Callable[[], Awaitable[Any]], name: str
) -> Callable[[], Coroutine[Any, Any, None]]:
    async def loop() -> None:
        while True:
            try:
                await work()
            except Exception:  # a background loop must survive any single failure
                log.exception(f"{name} failed")
            await asyncio.sleep(interval)

    return loop


class CloseRequest(BaseModel):
    """Admin: close every epoch <= ``epoch`` of ``channel_id`` now."""

    channel_id: str
    epoch: int


class RevokeRequest(BaseModel):
    """Admin: revoke a client id."""

    client_id: str


def create_app(settings: ShufflerSettings | None = None) -> FastAPI:
    """The shuffler's FastAPI application; serve it through :func:`create_asgi`, which adds the
    ingest route (``uvicorn shuffler.app:create_asgi --factory``)."""
    settings = settings or ShufflerSettings()
    logs.configure(settings.log_level)
    engine = db.make_engine(settings.database_url)
    if db.is_sqlite(engine):
        event.listen(engine, "connect", _sqlite_checkpoint_interval)
    hpke_key = load_or_create_x25519(settings.key_dir / "hpke.pem")
    signing_key = load_or_create_ed25519(settings.key_dir / "signing.pem")
    core = ShufflerCore(settings, engine, KeyRing.of(hpke_key), signing_key)
    enroll_limit = TokenBucket(
        settings.enroll_per_minute / 60.0, max(1.0, settings.enroll_per_minute / 6)
    )
    contribution_limit = TokenBucket(settings.rate_per_second, settings.rate_burst)
    writer = CommitQueue(core, settings.commit_batch)
    max_body = settings.max_body_bytes
    http = httpx.Client(timeout=30.0)

    async def batching() -> None:
        if await asyncio.to_thread(core.run_batching):
            await asyncio.to_thread(core.forward_due, http)

    async def forwarding() -> None:
        await asyncio.to_thread(core.forward_due, http)

    async def retention() -> None:
        await asyncio.to_thread(core.purge)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(db.wait_for, engine)
        await asyncio.to_thread(db.upgrade, engine, MIGRATIONS)
        await asyncio.to_thread(core.load_state)
        writer.start()
        tasks = [
            asyncio.create_task(_periodic(settings.batch_interval_seconds, batching, "batching")()),
            asyncio.create_task(
                _periodic(settings.forward_interval_seconds, forwarding, "forwarding")()
            ),
            asyncio.create_task(_periodic(60.0, retention, "retention")()),
        ]
        log.info(
            "shuffler ready",
            extra={
                "shuffler_id": settings.shuffler_id,
                "channels": [c.id for c in settings.channels],
            },
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(writer.stop)
            http.close()
            engine.dispose()

    app = FastAPI(title=f"ESA shuffler {settings.shuffler_id}", lifespan=lifespan)
    app.state.core = core
    registry = CollectorRegistry(auto_describe=True)
    registry.register(CoreCollector(core))

    install_error_handlers(app, log, core._count)

    def admin(request: Request) -> None:
        supplied = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        expected = settings.admin_token.get_secret_value()
        if not supplied or not hmac.compare_digest(supplied, expected):
            raise RejectedError(401, "bad_admin_token", "admin token missing or wrong")

    @app.post("/v1/enroll", status_code=200)
    async def enroll(request: Request) -> JSONResponse:
        host = request.client.host if request.client else "unknown"
        wait = enroll_limit.take(host, time.monotonic())
        if wait:
            core._count("rejected_rate_limited")
            return error(
                429, "rate_limited", "too many enrolments", {"Retry-After": str(math.ceil(wait))}
            )
        return JSONResponse(EnrollResponse(client_token=core.tokens.issue()).model_dump())

    async def ingest(
        raw_headers: list[tuple[bytes, bytes]], receive: Any
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """One contribution: (status, JSON body, extra headers)."""
        headers = dict(raw_headers)
        try:
            token = headers.get(b"authorization", b"")
            if not token.startswith(b"Bearer "):
                raise RejectedError(
                    401, "bad_token", "Authorization: Bearer <client token> required"
                )
            client_token = token[7:].strip().decode("latin-1")
            client_id = core.tokens.verify(client_token)
            wait = contribution_limit.take(client_id, time.monotonic())
            if wait:
                core._count("rejected_rate_limited")
                retry = (b"retry-after", str(math.ceil(wait)).encode())
                return 429, _error_json("rate_limited", "slow down"), [retry]
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > max_body:
                raise RejectedError(413, "too_large", f"body of {int(declared)} bytes > {max_body}")
            body = await _read_body(receive, max_body)
            if headers.get(b"content-type", b"").split(b";")[0] != b"application/octet-stream":
                raise RejectedError(
                    400,
                    "bad_content_type",
                    "send the sealed contribution as application/octet-stream",
                )
            pending = core.validate(client_token, body, client_id)
            stored = await writer.submit(pending)
            if stored.rejection is not None:
                raise stored.rejection
        except RejectedError as rejected:
            core._count(f"rejected_{rejected.error}")
            return rejected.status, _error_json(rejected.error, rejected.detail), []
        core._count("contributions_received")
        # Receipt is 32 hex digits: this is json.dumps(Receipt(receipt=...).model_dump()).
        return 202, b'{"receipt": "' + str(stored.receipt).encode() + b'"}', []

    app.state.ingest = ingest

    @app.get("/v1/config")
    async def config() -> dict[str, Any]:
        return {
            "id": settings.shuffler_id,
            **public_identity(hpke_key.public_key(), signing_key.public_key()),
            "channels": [c.model_dump() for c in settings.channels],
        }

    add_operational_routes(app, engine, registry)

    @app.post("/v1/admin/close")
    async def close(request: Request, body: CloseRequest) -> dict[str, int]:
        admin(request)
        groups = await asyncio.to_thread(core.close, body.channel_id, body.epoch)
        forwarded = await asyncio.to_thread(core.forward_due, http)
        return {"groups_evaluated": groups, **forwarded}

    @app.post("/v1/admin/revoke")
    async def revoke(request: Request, body: RevokeRequest) -> dict[str, str]:
        admin(request)
        await asyncio.to_thread(core.revoke, body.client_id)
        return {"revoked": body.client_id}

    return app


def create_asgi(settings: ShufflerSettings | None = None) -> IngestFastPath:
    """What ``esa shuffler serve`` runs: the FastAPI app behind the ingest fast path."""
    return IngestFastPath(create_app(settings))
