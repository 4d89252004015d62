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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError

from common.envelope import (
    KeyRing,
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
)
from common.wire import EnrollResponse, ErrorBody, Receipt, b64
from services import db, logs
from services.http import RejectedError, add_operational_routes, error, install_error_handlers
from shuffler.core import Pending, ShufflerCore, Stored
from shuffler.settings import ShufflerSettings

log = logging.getLogger("esa.shuffler")
MIGRATIONS = Path(__file__).parent / "migrations"


def _error_body(code: str, detail: str) -> dict[str, str]:
    return ErrorBody(error=code, detail=detail).model_dump()


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
        headers = dict(scope["headers"])
        limit = self.app.state.max_body_bytes

        async def read() -> bytes:
            body = bytearray()
            while True:
                message = await receive()
                body += message.get("body", b"")
                if len(body) > limit:
                    raise RejectedError(413, "too_large", f"body exceeds {limit} bytes")
                if not message.get("more_body", False):
                    return bytes(body)

        status, payload, extra = await self.app.state.ingest(headers, read)
        data = json.dumps(payload).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": data})


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
    """Group commit: one writer task stores queued contributions in shared transactions."""

    def __init__(self, core: ShufflerCore, max_batch: int) -> None:
        self.core = core
        self.max_batch = max_batch
        self.queue: asyncio.Queue[tuple[Pending, asyncio.Future[Stored]]] = asyncio.Queue()

    async def submit(self, pending: Pending) -> Stored:
        future: asyncio.Future[Stored] = asyncio.get_running_loop().create_future()
        await self.queue.put((pending, future))
        return await future

    async def run(self) -> None:
        while True:
            items = [await self.queue.get()]
            while len(items) < self.max_batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                results = await asyncio.to_thread(self.core.store, [p for p, _ in items])
            except SQLAlchemyError as failure:
                log.error("storage unavailable", extra={"error": type(failure).__name__})
                for _, future in items:
                    if not future.done():
                        future.set_exception(
                            RejectedError(
                                503,
                                "storage_unavailable",
                                "the database did not commit; nothing was stored",
                            )
                        )
                continue
            for (_, future), result in zip(items, results, strict=True):
                if not future.done():
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


def _periodic(
    interval: float, work: Callable[[], Awaitable[Any]], name: str
) -> Callable[[], Awaitable[None]]:
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
    hpke_key = load_or_create_x25519(settings.key_dir / "hpke.pem")
    signing_key = load_or_create_ed25519(settings.key_dir / "signing.pem")
    core = ShufflerCore(settings, engine, KeyRing.of(hpke_key), signing_key)
    enroll_limit = TokenBucket(
        settings.enroll_per_minute / 60.0, max(1.0, settings.enroll_per_minute / 6)
    )
    contribution_limit = TokenBucket(settings.rate_per_second, settings.rate_burst)
    writer = CommitQueue(core, settings.commit_batch)
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
        tasks = [
            asyncio.create_task(writer.run()),
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
            http.close()
            engine.dispose()

    app = FastAPI(title=f"ESA shuffler {settings.shuffler_id}", lifespan=lifespan)
    app.state.core = core
    app.state.max_body_bytes = settings.max_body_bytes
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
        headers: dict[bytes, bytes], read: Callable[[], Awaitable[bytes]]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """One contribution: (status, JSON body, extra headers)."""
        try:
            token = headers.get(b"authorization", b"").decode("latin-1")
            if not token.startswith("Bearer "):
                raise RejectedError(
                    401, "bad_token", "Authorization: Bearer <client token> required"
                )
            client_token = token.removeprefix("Bearer ").strip()
            client_id = core.tokens.verify(client_token)
            wait = contribution_limit.take(client_id, time.monotonic())
            if wait:
                core._count("rejected_rate_limited")
                return (
                    429,
                    _error_body("rate_limited", "slow down"),
                    {"Retry-After": str(math.ceil(wait))},
                )
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > settings.max_body_bytes:
                raise RejectedError(
                    413, "too_large", f"body of {int(declared)} bytes > {settings.max_body_bytes}"
                )
            body = await read()
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
            return rejected.status, _error_body(rejected.error, rejected.detail), {}
        core._count("contributions_received")
        return 202, Receipt(receipt=str(stored.receipt)).model_dump(), {}

    app.state.ingest = ingest

    @app.get("/v1/config")
    async def config() -> dict[str, Any]:
        public = hpke_key.public_key()
        return {
            "id": settings.shuffler_id,
            "public_key": b64(public_bytes(public)),
            "key_id": key_id(public).hex(),
            "signing_key": b64(public_bytes(signing_key.public_key())),
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
