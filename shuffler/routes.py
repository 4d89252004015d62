"""The shuffler's FastAPI routes (PROTOCOL.md, "HTTP endpoints"), thin over
:class:`~shuffler.service.ShufflerService` with typed dependencies.

``POST /v1/contributions`` is not here: it is the raw ASGI route of :mod:`shuffler.ingest`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, cast

import httpx
from fastapi import APIRouter, Depends, Request

from common.wire import (
    CloseRequest,
    CloseResult,
    EnrollResponse,
    RevokeRequest,
    RevokeResult,
    ShufflerConfig,
)
from services.runtime.http import bearer_matches, error_responses
from shuffler.errors import AdminTokenError
from shuffler.service import ShufflerService


def get_service(request: Request) -> ShufflerService:
    """The app's service (set when the app is built)."""
    return cast(ShufflerService, request.app.state.service)


def get_http(request: Request) -> httpx.Client:
    """The app's HTTP client to the analyzer (closed at shutdown)."""
    return cast(httpx.Client, request.app.state.http)


Service = Annotated[ShufflerService, Depends(get_service)]
Http = Annotated[httpx.Client, Depends(get_http)]


def require_admin(request: Request, service: Service) -> None:
    """Admin routes need ``Authorization: Bearer <admin token>``.

    Raises:
        AdminTokenError: missing or wrong.
    """
    expected = service.settings.admin_token.get_secret_value()
    if not bearer_matches(request.headers.get("authorization"), expected):
        raise AdminTokenError("admin token missing or wrong")


public = APIRouter(tags=["clients"])
admin = APIRouter(
    prefix="/v1/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses=error_responses(401),
)


@public.post("/v1/enroll", response_model=EnrollResponse, responses=error_responses(429))
async def enroll(request: Request, service: Service) -> EnrollResponse:
    """Issue a client token (rate-limited per address)."""
    address = request.client.host if request.client else "unknown"
    return EnrollResponse(client_token=service.enroll(address))


@public.get("/v1/config", response_model=ShufflerConfig)
async def config(service: Service) -> ShufflerConfig:
    """The shuffler's public keys and the channel policies it enforces."""
    return service.config()


@admin.post("/close", response_model=CloseResult, responses=error_responses(422))
async def close(body: CloseRequest, service: Service, http: Http) -> CloseResult:
    """Close every epoch <= ``epoch`` of a channel now, evaluate its groups, forward."""
    groups = await asyncio.to_thread(service.close, body.channel_id, body.epoch)
    forwarded = await asyncio.to_thread(service.forward_due, http)
    return CloseResult(groups_evaluated=groups, **forwarded)


@admin.post("/revoke", response_model=RevokeResult)
async def revoke(body: RevokeRequest, service: Service) -> RevokeResult:
    """Refuse a client's token from now on."""
    await asyncio.to_thread(service.revoke, body.client_id)
    return RevokeResult(revoked=body.client_id)
