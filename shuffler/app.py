"""The shuffler's ASGI application: FastAPI routes (:mod:`shuffler.routes`), the raw ingest
route (:mod:`shuffler.ingest`), operational routes and background loops over one
:class:`~shuffler.service.ShufflerService`.

Serve with ``uvicorn shuffler.app:create_asgi --factory`` (what ``esa shuffler serve`` runs).
Every error is JSON ``{"error", "detail"}`` (:mod:`runtime.http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from common.fetching import deadline_client
from runtime import db, logs
from runtime.cors import Cors, document_preflights, install_cors
from runtime.deadlines import ReadGuard
from runtime.http import (
    add_operational_routes,
    document_errors,
    install_error_handlers,
)
from runtime.server import HEAD_LIMIT
from shuffler import routes
from shuffler.ingest import ROUTE, CommitQueue, Ingest, IngestFastPath
from shuffler.metrics import ShufflerCollector
from shuffler.service import ShufflerService, build_service
from shuffler.settings import ShufflerSettings

log = logging.getLogger("esa.shuffler")
#: The OpenAPI description: the answers that no single route gives.
DESCRIPTION = (
    'Every answer other than 2xx is JSON `{"error": code, "detail": sentence}`. Besides the '
    "statuses each operation lists, the server itself answers before routing: 400 "
    "`malformed_http` to a request that is not valid HTTP/1.1 (framing such as "
    f"`Content-Length: -1`), 431 `head_too_large` to a request line and headers over {HEAD_LIMIT} "
    "bytes, 408 `head_timeout` or `body_timeout` to a request whose head or body did not arrive "
    "within the configured deadline or arrived below the minimum rate (all close the "
    "connection), 404 `not_found` to an unknown path and 405 "
    "`method_not_allowed` (with `Allow`) to a method a path does not serve. Only the device "
    "routes (contributions, enroll, descriptor) answer a web page of an origin in "
    "`ESA_SHUFFLER_CORS_ORIGINS` (none by default): a CORS preflight (`OPTIONS` with "
    "`Access-Control-Request-Method`) to any other path is 403 `cors_route_refused`."
)
MIGRATIONS = Path(__file__).parent / "migrations"
#: Seconds between retention purges (retention itself is days; a minute bounds the overshoot).
RETENTION_INTERVAL = 60.0
#: Seconds one POST of a batch to the analyzer may take.
ANALYZER_TIMEOUT = 30.0
#: Seconds a stop waits for the background work in flight (a part being POSTed under its
#: forwarding lease) before the store lets go of its database file.
STOP_GRACE_SECONDS = 10.0


class _Loops:
    """The background loops' threads: a stop waits for the work in flight before the store
    lets go of its SQLite file, so a successor that takes the file over (and with it every
    forwarding lease, :meth:`shuffler.store.ContributionStore.start_writing`) never sends a
    part this process is still sending."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(3, thread_name_prefix="esa-loop")
        self.running: set[Future[Any]] = set()

    async def run(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` on the loops' threads."""
        future = self.pool.submit(work, *args)
        self.running.add(future)
        future.add_done_callback(self.running.discard)
        return await asyncio.wrap_future(future)

    def stop(self, grace: float) -> bool:
        """Take no more work; whether the work in flight ended within ``grace`` seconds."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        _, pending = wait(list(self.running), timeout=grace)
        return not pending


async def _periodic(interval: float, work: Callable[[], Awaitable[Any]], name: str) -> None:
    while True:
        try:
            await work()
        except Exception:  # a background loop must survive any single failure
            log.exception(f"{name} failed")
        await asyncio.sleep(interval)


def _background(
    service: ShufflerService, http: httpx.Client, loops: _Loops
) -> list[asyncio.Task[None]]:
    """Batching (then forwarding what it released, then sweeping dead rows), forwarding
    retries, retention."""
    settings = service.settings

    async def batching() -> None:
        if await loops.run(service.run_batching):
            await loops.run(service.forward_due, http)
        await loops.run(service.sweep)

    async def forwarding() -> None:
        await loops.run(service.forward_due, http)

    async def retention() -> None:
        await loops.run(service.purge)

    return [
        asyncio.create_task(_periodic(settings.batch_interval_seconds, batching, "batching")),
        asyncio.create_task(_periodic(settings.forward_interval_seconds, forwarding, "forwarding")),
        asyncio.create_task(_periodic(RETENTION_INTERVAL, retention, "retention")),
    ]


async def _prepare(service: ShufflerService) -> Path | None:
    """Claim the database (before migrating it: one writing process per SQLite file), migrate
    it, load the state, prepare writing and publish the descriptor (its path). On a failure the
    store lets go of the file, so a process that goes on (a test's) can open it again."""
    engine = service.store.engine
    try:
        await asyncio.to_thread(service.store.claim_file)
        await asyncio.to_thread(db.wait_for, engine)
        await asyncio.to_thread(db.upgrade, engine, MIGRATIONS)
        await asyncio.to_thread(service.load_state)
        await asyncio.to_thread(service.store.start_writing)
        return await asyncio.to_thread(service.publish)
    except BaseException:
        service.store.close()
        raise


def _lifespan(
    service: ShufflerService, writer: CommitQueue, http: httpx.Client
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    engine = service.store.engine

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        published = await _prepare(service)
        writer.start()
        loops = _Loops()
        tasks = _background(service, http, loops)
        channels = [c.id for c in service.policies.all()]
        # Its own client, no connection kept alive: each fetch's deadline watches its socket.
        fetching = deadline_client(service.settings.config_fetch_deadline_seconds)
        if service.follower is not None:
            follower = threading.Thread(
                target=service.follower.run, args=(fetching,), name="esa-config", daemon=True
            )
            follower.start()
        log.info(
            "shuffler ready",
            extra={
                "shuffler_id": service.settings.shuffler_id,
                "channels": channels,
                "descriptor_published": str(published) if published else None,
            },
        )
        try:
            yield
        finally:
            if service.follower is not None:
                service.follower.stop()
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(writer.stop)
            idle = await asyncio.to_thread(loops.stop, STOP_GRACE_SECONDS)
            http.close()
            fetching.close()
            if idle:
                service.store.close()
            else:  # the file stays claimed until this process exits (the OS lets it go)
                log.warning("background work still running at stop; the database stays claimed")
            engine.dispose()

    return lifespan


def create_app(settings: ShufflerSettings | None = None) -> FastAPI:
    """The shuffler's FastAPI application; serve it through :func:`create_asgi`, which adds the
    ingest route."""
    settings = settings or ShufflerSettings()
    logs.configure(settings.log_level)
    service = build_service(settings)
    writer = CommitQueue(
        service, settings.commit_batch, settings.commit_fill, settings.commit_wait_seconds
    )
    http = httpx.Client(timeout=ANALYZER_TIMEOUT)
    app = FastAPI(
        title=f"ESA shuffler {settings.shuffler_id}",
        description=DESCRIPTION,
        lifespan=_lifespan(service, writer, http),
    )
    app.state.service, app.state.http = service, http
    app.state.ingest = Ingest(service, writer)
    app.state.read_guard = ReadGuard(settings.read_deadlines(), service.events.count)
    install_error_handlers(app, log, service.events.count, service.events.refuse)
    cors = Cors(settings.allowed_origins, routes.DEVICE_ROUTES)
    install_cors(app, cors, service.events.refuse)
    # The ingest as the fast path serves it, outside the middleware: with the grant added.
    app.state.direct_ingest = cors.direct(ROUTE, app.state.ingest)
    refine = functools.partial(_document_channels, settings)
    document_errors(app, refine, add=document_preflights(cors))
    app.include_router(routes.public)
    app.include_router(routes.admin)
    registry = CollectorRegistry(auto_describe=True)
    collector = ShufflerCollector(
        service.events, service.store.ledger_by_cause, service.store.channel_health
    )
    registry.register(collector)
    token = settings.metrics_token or settings.admin_token
    add_operational_routes(app, service.store.engine, registry, token.get_secret_value())
    return app


def _document_channels(settings: ShufflerSettings, schema: dict[str, Any]) -> None:
    """The channels this instance serves, as the enum of ``CloseRequest.channel_id``: any
    other channel is invalid input (400), as the document then says."""
    if settings.follows_analyzer:  # channels are added while it runs
        return
    ids = [channel.id for channel in settings.channels]
    close = schema.get("components", {}).get("schemas", {}).get("CloseRequest")
    if ids and close is not None:
        close["properties"]["channel_id"]["enum"] = ids


def create_asgi(settings: ShufflerSettings | None = None) -> IngestFastPath:
    """What ``esa shuffler serve`` runs: the FastAPI app behind the ingest fast path."""
    return IngestFastPath(create_app(settings))
