"""The analyzer's HTTP API: thin routers over :class:`analyzer.service.AnalyzerService`.

``POST /v1/batches`` (one signed part of a batch from a registered shuffler: 201 stored, 200
known part, 401, 413, 422; opened in the background), ``GET /v1/config`` (the signed
collection config), ``GET /v1/channels``,
``GET /v1/channels/{id}/estimate`` (a release: estimates, 95% intervals, certified (ε, δ); a
pure read), ``POST /v1/channels/{id}/releases`` (admin: publish and record a release),
``GET /v1/channels/{id}/privacy`` (per-epoch charges and lifetime ε), ``GET /v1/privacy``
(lifetime ε across channels), ``GET /`` (dashboard),
``/healthz``, ``/readyz``, ``/metrics``. Every non-2xx answer is JSON ``{"error", "detail"}``
(:mod:`services.runtime.http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry

from analyzer import dashboard
from analyzer.errors import AdminTokenError
from analyzer.metrics import EventsCollector
from analyzer.service import AnalyzerService
from analyzer.settings import AnalyzerSettings
from common.wire import (
    MAX_INT,
    BatchAck,
    ChannelList,
    Ledger,
    PrivacyOverview,
    ReleaseBody,
    ReleaseRequest,
    SignedConfig,
)
from services.runtime import logs
from services.runtime.http import (
    ERROR_RESPONSES,
    add_operational_routes,
    bearer_matches,
    error_responses,
    install_error_handlers,
)

log = logging.getLogger("esa.analyzer")


def get_service(request: Request) -> AnalyzerService:
    """The application's analyzer service (a FastAPI dependency)."""
    service: AnalyzerService = request.app.state.service
    return service


Service = Annotated[AnalyzerService, Depends(get_service)]


def require_admin(service: Service, authorization: Annotated[str | None, Header()] = None) -> None:
    """Admin routes need ``Authorization: Bearer <admin token>`` (401 JSON otherwise)."""
    if not bearer_matches(authorization, service.settings.admin_token.get_secret_value()):
        raise AdminTokenError("Authorization: Bearer <admin token> required")


batches = APIRouter(tags=["batches"])
channels = APIRouter(prefix="/v1/channels", tags=["channels"])
pages = APIRouter(tags=["dashboard"])


@batches.post(
    "/v1/batches",
    status_code=201,
    response_model=BatchAck,
    response_model_exclude_none=True,
    responses={
        200: {"model": BatchAck, "description": "Known (batch_id, part) (counted once)"},
        **error_responses(413, 422),
    },
)
async def post_batch(
    request: Request,
    response: Response,
    service: Service,
    esa_signature: Annotated[str | None, Header()] = None,
) -> BatchAck:
    """Store one signed part of a batch from a registered shuffler (opened later)."""
    body = await request.body()
    ack = await asyncio.to_thread(service.accept, body, esa_signature)
    if ack.duplicate:
        response.status_code = 200
    return ack


@batches.get("/v1/config", response_model=SignedConfig)
async def get_config(service: Service) -> SignedConfig:
    """The signed collection config devices fetch."""
    return service.config()


@channels.get("", response_model=ChannelList)
async def list_channels(service: Service) -> ChannelList:
    """Configured channels and the epochs received so far."""
    return await asyncio.to_thread(service.channels)


@channels.get("/{channel_id}/estimate", response_model=ReleaseBody)
async def get_estimate(
    service: Service,
    channel_id: str,
    epoch: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    epoch_from: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    epoch_to: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    top: Annotated[int | None, Query(ge=1, le=MAX_INT)] = None,
) -> ReleaseBody:
    """A release over ``epoch`` or ``[epoch_from, epoch_to]`` (default: the last epoch)."""
    return await asyncio.to_thread(service.estimate, channel_id, epoch, epoch_from, epoch_to, top)


@channels.post(
    "/{channel_id}/releases",
    status_code=201,
    response_model=ReleaseBody,
    responses=error_responses(401),
    dependencies=[Depends(require_admin)],
)
async def post_release(
    service: Service, channel_id: str, request: Annotated[ReleaseRequest | None, Body()] = None
) -> ReleaseBody:
    """Publish a release over the requested epochs (default: the last) and record it."""
    wanted = request or ReleaseRequest()
    return await asyncio.to_thread(service.publish, channel_id, wanted)


@channels.get("/{channel_id}/privacy", response_model=Ledger)
async def get_privacy(service: Service, channel_id: str) -> Ledger:
    """The channel's privacy ledger: each epoch's certificate and the lifetime ε."""
    return await asyncio.to_thread(service.privacy, channel_id)


@batches.get("/v1/privacy", response_model=PrivacyOverview)
async def get_lifetime(service: Service) -> PrivacyOverview:
    """The lifetime ε of a device that took part in every channel."""
    return await asyncio.to_thread(service.lifetime)


@pages.get("/", response_class=HTMLResponse)
async def home(service: Service) -> HTMLResponse:
    """The dashboard."""
    views = await asyncio.to_thread(service.overview)
    return HTMLResponse(dashboard.page(views))


def create_app(settings: AnalyzerSettings | None = None) -> FastAPI:
    """The analyzer application.

    Raises:
        InvalidChannelError: if a configured channel does not validate.
    """
    settings = settings or AnalyzerSettings()
    logs.configure(settings.log_level)
    service = AnalyzerService.from_settings(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(service.start)
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="ESA analyzer", lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.service = service
    install_error_handlers(app, log, service.events.count)
    for router in (batches, channels, pages):
        app.include_router(router)
    metrics = CollectorRegistry(auto_describe=True)
    metrics.register(EventsCollector(service.events, service.store.unopened_parts))
    add_operational_routes(app, service.store.engine, metrics)
    return app
