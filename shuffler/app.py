"""The shuffler's ASGI application: FastAPI routes (:mod:`shuffler.routes`), the raw ingest
route (:mod:`shuffler.ingest`), operational routes and background loops over one
:class:`~shuffler.service.ShufflerService`.

Serve with ``uvicorn shuffler.app:create_asgi --factory`` (what ``esa shuffler serve`` runs).
Every error is JSON ``{"error", "detail"}`` (:mod:`services.runtime.http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.runtime import db, logs
from services.runtime.http import ERROR_RESPONSES, add_operational_routes, install_error_handlers
from shuffler import routes
from shuffler.ingest import CommitQueue, Ingest, IngestFastPath
from shuffler.metrics import ShufflerCollector
from shuffler.service import ShufflerService, build_service
from shuffler.settings import ShufflerSettings

log = logging.getLogger("esa.shuffler")
MIGRATIONS = Path(__file__).parent / "migrations"
#: Seconds between retention purges (retention itself is days; a minute bounds the overshoot).
RETENTION_INTERVAL = 60.0
#: Seconds one POST of a batch to the analyzer may take.
ANALYZER_TIMEOUT = 30.0


async def _periodic(interval: float, work: Callable[[], Awaitable[Any]], name: str) -> None:
    while True:
        try:
            await work()
        except Exception:  # a background loop must survive any single failure
            log.exception(f"{name} failed")
        await asyncio.sleep(interval)


def _background(service: ShufflerService, http: httpx.Client) -> list[asyncio.Task[None]]:
    """Batching (then forwarding what it released), forwarding retries, retention."""
    settings = service.settings

    async def batching() -> None:
        if await asyncio.to_thread(service.run_batching):
            await asyncio.to_thread(service.forward_due, http)

    async def forwarding() -> None:
        await asyncio.to_thread(service.forward_due, http)

    async def retention() -> None:
        await asyncio.to_thread(service.purge)

    return [
        asyncio.create_task(_periodic(settings.batch_interval_seconds, batching, "batching")),
        asyncio.create_task(_periodic(settings.forward_interval_seconds, forwarding, "forwarding")),
        asyncio.create_task(_periodic(RETENTION_INTERVAL, retention, "retention")),
    ]


def _lifespan(
    service: ShufflerService, writer: CommitQueue, http: httpx.Client
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    engine = service.store.engine

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(db.wait_for, engine)
        await asyncio.to_thread(db.upgrade, engine, MIGRATIONS)
        await asyncio.to_thread(service.load_state)
        writer.start()
        tasks = _background(service, http)
        channels = [c.id for c in service.settings.channels]
        log.info(
            "shuffler ready",
            extra={"shuffler_id": service.settings.shuffler_id, "channels": channels},
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(writer.stop)
            http.close()
            engine.dispose()

    return lifespan


def create_app(settings: ShufflerSettings | None = None) -> FastAPI:
    """The shuffler's FastAPI application; serve it through :func:`create_asgi`, which adds the
    ingest route."""
    settings = settings or ShufflerSettings()
    logs.configure(settings.log_level)
    service = build_service(settings)
    writer = CommitQueue(service, settings.commit_batch)
    http = httpx.Client(timeout=ANALYZER_TIMEOUT)
    app = FastAPI(
        title=f"ESA shuffler {settings.shuffler_id}",
        lifespan=_lifespan(service, writer, http),
        responses=ERROR_RESPONSES,
    )
    app.state.service, app.state.http = service, http
    app.state.ingest = Ingest(service, writer)
    install_error_handlers(app, log, service.events.count)
    app.include_router(routes.public)
    app.include_router(routes.admin)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ShufflerCollector(service.events, service.ledger))
    token = settings.metrics_token or settings.admin_token
    add_operational_routes(app, service.store.engine, registry, token.get_secret_value())
    return app


def create_asgi(settings: ShufflerSettings | None = None) -> IngestFastPath:
    """What ``esa shuffler serve`` runs: the FastAPI app behind the ingest fast path."""
    return IngestFastPath(create_app(settings))
