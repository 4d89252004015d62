"""The analyzer's HTTP API: a thin FastAPI layer over :class:`analyzer.core.AnalyzerCore`.

``POST /v1/batches`` (signed batch from a registered shuffler: 201 accepted, 200 duplicate,
401, 422), ``GET /v1/config`` (the signed collection config), ``GET /v1/channels``,
``GET /v1/channels/{id}/estimate`` (a release: estimates, 95% intervals, certified (ε, δ);
appended to the ledger), ``GET /v1/channels/{id}/privacy`` (the ledger), ``GET /`` (dashboard),
``/healthz``, ``/readyz``, ``/metrics``. Every error is JSON ``{"error", "detail"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from sqlalchemy import func, select

from analyzer import dashboard, storage
from analyzer.channels import ChannelRuntime
from analyzer.core import AnalyzerCore, latest_release, ledger_rows
from analyzer.settings import AnalyzerSettings
from common.collection import sign_config
from common.envelope import (
    KeyRing,
    key_id,
    load_ed25519_public,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
)
from common.wire import (
    AnalyzerInfo,
    AnalyzerKey,
    CollectionConfig,
    SignedConfig,
    b64,
    unb64,
)
from services.runtime import db, logs
from services.runtime.http import RejectedError, add_operational_routes, install_error_handlers

log = logging.getLogger("esa.analyzer")
MIGRATIONS = Path(__file__).parent / "migrations"
#: Bins returned by default for large histograms (``?top=N`` asks for more).
DEFAULT_TOP = 10_000


class CoreCollector:
    """Prometheus metrics read from the core at scrape time."""

    def __init__(self, core: AnalyzerCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Any]:
        names = {
            "batches_accepted": "batches accumulated",
            "batches_duplicate": "batches seen before (counted once)",
            "fragments_opened": "fragments opened",
            "fragments_invalid": "fragments that failed to open or parse (chaff)",
            "releases": "estimates released (ledger entries)",
        }
        for name, help_text in names.items():
            yield CounterMetricFamily(
                f"esa_analyzer_{name}", help_text, value=self.core.events.get(name, 0)
            )
        rejected = CounterMetricFamily(
            "esa_analyzer_batches_rejected", "refused batches", labels=["reason"]
        )
        for key, value in self.core.events.items():
            if key.startswith("rejected_"):
                rejected.add_metric([key.removeprefix("rejected_")], value)
        yield rejected


def create_app(settings: AnalyzerSettings | None = None) -> FastAPI:
    """The analyzer application."""
    settings = settings or AnalyzerSettings()
    logs.configure(settings.log_level)
    engine = db.make_engine(settings.database_url)
    current = load_or_create_x25519(settings.key_dir / "hpke.pem")
    live = [current]
    previous_path = settings.key_dir / "hpke-previous.pem"
    if previous_path.exists():
        live.append(load_or_create_x25519(previous_path))
    signing_key = load_or_create_ed25519(settings.key_dir / "signing.pem")
    shuffler_ids = [s.id for s in settings.shufflers]
    channels = {c.id: ChannelRuntime.build(c, shuffler_ids) for c in settings.channels}
    registry = {s.id: load_ed25519_public(unb64(s.signing_key)) for s in settings.shufflers}
    core = AnalyzerCore(engine, KeyRing.of(*live), channels, registry)

    def collection_config() -> CollectionConfig:
        now = int(time.time())
        keys = [
            AnalyzerKey(
                key_id=key_id(k.public_key()).hex(), public_key=b64(public_bytes(k.public_key()))
            )
            for k in live
        ]
        analyzer = AnalyzerInfo(
            url=settings.url, keys=keys, signing_key=b64(public_bytes(signing_key.public_key()))
        )
        return CollectionConfig(
            issued_at=now,
            expires_at=now + settings.config_ttl_seconds,
            analyzer=analyzer,
            shufflers=list(settings.shufflers),
            channels=list(settings.channels),
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(db.wait_for, engine)
        await asyncio.to_thread(db.upgrade, engine, MIGRATIONS)
        log.info("analyzer ready", extra={"channels": list(channels), "shufflers": shuffler_ids})
        try:
            yield
        finally:
            engine.dispose()

    app = FastAPI(title="ESA analyzer", lifespan=lifespan)
    app.state.core = core
    metrics_registry = CollectorRegistry(auto_describe=True)
    metrics_registry.register(CoreCollector(core))

    install_error_handlers(app, log, core._count)

    @app.post("/v1/batches")
    async def batches(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > settings.max_batch_bytes:
            raise RejectedError(413, "too_large", f"batch exceeds {settings.max_batch_bytes} bytes")
        signature = request.headers.get("esa-signature")
        if not signature:
            raise RejectedError(401, "bad_signature", "ESA-Signature header required")
        intake = await asyncio.to_thread(core.accept, body, signature)
        if intake.duplicate:
            return JSONResponse({"batch_id": intake.batch_id, "duplicate": True}, 200)
        return JSONResponse(
            {
                "batch_id": intake.batch_id,
                "duplicate": False,
                "fragments": intake.opened,
                "invalid": intake.invalid,
            },
            201,
        )

    @app.get("/v1/config")
    async def config() -> SignedConfig:
        return sign_config(collection_config(), signing_key)

    @app.get("/v1/channels")
    async def list_channels() -> dict[str, Any]:
        def epochs() -> dict[str, list[int]]:
            r = storage.receipts.c
            query = select(r.channel_id, func.min(r.epoch), func.max(r.epoch)).group_by(
                r.channel_id
            )
            with engine.connect() as conn:
                return {c: [int(lo), int(hi)] for c, lo, hi in conn.execute(query)}

        seen = await asyncio.to_thread(epochs)
        return {
            "channels": [{**c.model_dump(), "epochs": seen.get(c.id)} for c in settings.channels]
        }

    @app.get("/v1/channels/{channel_id}/estimate")
    async def estimate(
        channel_id: str,
        epoch: int | None = None,
        epoch_from: int | None = None,
        epoch_to: int | None = None,
        top: int | None = None,
    ) -> dict[str, Any]:
        if channel_id not in channels:
            raise RejectedError(404, "unknown_channel", f"channel {channel_id!r} is not configured")
        if epoch is not None:
            epoch_from = epoch_to = epoch
        if epoch_from is None or epoch_to is None:
            seen = (await list_channels())["channels"]
            span = next(c["epochs"] for c in seen if c["id"] == channel_id)
            if span is None:
                raise RejectedError(404, "no_data", f"no batch received for {channel_id!r} yet")
            epoch_from = span[1] if epoch_from is None else epoch_from
            epoch_to = span[1] if epoch_to is None else epoch_to
        release = await asyncio.to_thread(core.release, channel_id, epoch_from, epoch_to)
        if top is None and release.estimate.values.size > DEFAULT_TOP:
            top = DEFAULT_TOP
        return release.as_dict(top)

    @app.get("/v1/channels/{channel_id}/privacy")
    async def privacy(channel_id: str) -> dict[str, Any]:
        if channel_id not in channels:
            raise RejectedError(404, "unknown_channel", f"channel {channel_id!r} is not configured")
        rows = await asyncio.to_thread(ledger_rows, engine, channel_id)
        return {
            "channel_id": channel_id,
            "releases": rows,
            "note": "cumulative ε and δ by basic composition over all releases",
        }

    @app.get("/", response_class=HTMLResponse)
    async def home() -> HTMLResponse:
        def gather() -> list[dict[str, Any]]:
            out = []
            for c in settings.channels:
                entry: dict[str, Any] = {"id": c.id, "mechanism": c.mechanism}
                found = latest_release(engine, c.id)
                if found is not None:
                    summary, image = found
                    entry["release"] = summary
                    entry["chart"] = dashboard.chart_for(c.display, summary, image)
                    entry["ledger"] = ledger_rows(engine, c.id)
                out.append(entry)
            return out

        return HTMLResponse(dashboard.page(await asyncio.to_thread(gather)))

    add_operational_routes(app, engine, metrics_registry)

    return app
