"""The shuffler's FastAPI routes (docs/protocol.md, "Routes"), thin over
:class:`~shuffler.service.ShufflerService` with typed dependencies; each documents every status
it answers (the server-level 400/431/500 are added by
:func:`runtime.http.document_errors`).

``POST /v1/contributions`` is served by the raw ASGI fast path of :mod:`shuffler.ingest` in
front of this app; the route here is the same :class:`~shuffler.ingest.Ingest` call (what an
in-process client reaches) and what documents it, so a wrong method on its path is a 405.
Admin routes check the admin token before FastAPI reads the body
(:func:`runtime.http.checked_route`): without the token any body is a 401.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, cast

import httpx
from fastapi import APIRouter, Depends, Request, Response

from common.wire import (
    CloseRequest,
    CloseResult,
    EnrollResponse,
    KeyChange,
    KeyList,
    Receipt,
    RequeueRequest,
    RequeueResult,
    RetireKeyRequest,
    RevokeRequest,
    RevokeResult,
    RotateKeyRequest,
    ShufflerConfig,
    SignedDescriptor,
)
from runtime.cors import DeviceRoute
from runtime.http import bearer_check, bearer_scheme, checked_route, error_responses
from runtime.keys import LiveKeys, NoSuchKeyError
from shuffler.errors import AdminTokenError
from shuffler.ingest import CONTENT_TYPE, ROUTE, Ingest
from shuffler.service import ShufflerService


def get_service(request: Request) -> ShufflerService:
    """The app's service (set when the app is built)."""
    return cast(ShufflerService, request.app.state.service)


def get_http(request: Request) -> httpx.Client:
    """The app's HTTP client to the analyzer (closed at shutdown)."""
    return cast(httpx.Client, request.app.state.http)


Service = Annotated[ShufflerService, Depends(get_service)]
Http = Annotated[httpx.Client, Depends(get_http)]


def _admin_secret(request: Request) -> str:
    return get_service(request).settings.admin_token.get_secret_value()


#: Admin routes need ``Authorization: Bearer <admin token>``, checked before the body is read.
require_admin = bearer_check(_admin_secret, AdminTokenError, "admin token missing or wrong")

public = APIRouter(tags=["clients"])
admin = APIRouter(
    prefix="/v1/admin",
    tags=["admin"],
    route_class=checked_route(require_admin),
    dependencies=[bearer_scheme("AdminToken", "the shuffler's admin token")],
)

#: What a device calls, with the request headers it sends beyond the CORS-safelisted ones: the
#: only routes a web page of an allowed origin may call (:mod:`runtime.cors`).
DEVICE_ROUTES = {
    ROUTE: DeviceRoute(("POST",), ("Authorization", "Content-Type")),
    "/v1/enroll": DeviceRoute(("POST",)),
    "/v1/descriptor": DeviceRoute(("GET",)),
}
#: ``POST /v1/contributions``: the sealed contribution as raw bytes.
CONTRIBUTION_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "One contribution sealed to this shuffler (HPKE, docs/protocol.md); at most "
        "``ESA_SHUFFLER_MAX_BODY_BYTES`` bytes",
        "content": {CONTENT_TYPE.decode(): {"schema": {"type": "string", "format": "binary"}}},
    }
}


@public.post(
    "/v1/contributions",
    status_code=202,
    response_model=Receipt,
    responses={
        202: {"description": "Stored (committed) before this answer; keep the receipt"},
        **error_responses(400, 401, 409, 413, 429, 503),
    },
    dependencies=[bearer_scheme("ClientToken", "a client token from POST /v1/enroll")],
    openapi_extra=CONTRIBUTION_BODY,
)
async def contribute(request: Request) -> Response:
    """Store one sealed contribution: 202 with a receipt only after it is committed; 400
    malformed, wrong content type, unknown channel or crowd, epoch not open (one that starts
    more than ``epoch_skew_seconds`` ahead included); 401 bad or revoked token; 409 replayed
    nonce or quota used, or ``config_outdated`` (sealed to a retired key of this shuffler, or
    fragments sealed to an analyzer key its config no longer lists: fetch the config again),
    or ``channel_terms_changed`` (the channel is suspended: the analyzer's config relaxed its
    privacy terms or put them over this shuffler's ceilings; nothing more is taken on it);
    413 too large or too many fragments; 429 slow down (``Retry-After``); 503 not stored: the
    database, or ``key_not_loaded`` (sealed to a key another replica has just made, which
    this one could not read yet: retry after ``Retry-After``)."""
    ingest: Ingest = request.app.state.ingest
    status, data, extra = await ingest(request.scope["headers"], request.receive)
    headers = {name.decode(): value.decode() for name, value in extra}
    return Response(data, status, headers=headers, media_type="application/json")


@public.post("/v1/enroll", response_model=EnrollResponse, responses=error_responses(429))
async def enroll(request: Request, service: Service) -> EnrollResponse:
    """Issue a client token (rate-limited per address)."""
    address = request.client.host if request.client else "unknown"
    return EnrollResponse(client_token=service.enroll(address))


@public.get("/v1/config", response_model=ShufflerConfig)
async def config(service: Service) -> ShufflerConfig:
    """The shuffler's public keys and the channel policies it enforces."""
    return service.config()


@public.get("/v1/descriptor", response_model=SignedDescriptor)
async def descriptor(service: Service) -> SignedDescriptor:
    """This shuffler's signed descriptor: its URL and HPKE keys, vouched for by its own
    signing key (devices pin that key and refuse a shuffler key nobody but this shuffler
    signed)."""
    return service.descriptor()


@admin.post("/close", response_model=CloseResult, responses=error_responses(400, 401, 422, 503))
async def close(body: CloseRequest, service: Service, http: Http) -> CloseResult:
    """Close every epoch <= ``epoch`` of a channel now, evaluate its groups, forward: 400
    invalid body or unknown channel, 401 admin token, 422 the epoch has not started."""
    groups = await asyncio.to_thread(service.close, body.channel_id, body.epoch)
    forwarded = await asyncio.to_thread(service.forward_due, http)
    return CloseResult(groups_evaluated=groups, **forwarded)


def _keys(service: ShufflerService) -> LiveKeys:
    """The service's live keys (every app has them; a service built by hand may not)."""
    if service.keys is None:
        raise NoSuchKeyError("this shuffler was built without a key directory")
    return service.keys


@admin.get("/keys", response_model=KeyList, responses=error_responses(401, 404, 503))
async def list_keys(service: Service) -> KeyList:
    """This shuffler's keys (HPKE and signing): state, times, which one is published, and the
    successions its signing keys made."""
    return await asyncio.to_thread(_keys(service).listing)


@admin.post(
    "/keys/rotate", response_model=KeyChange, responses=error_responses(400, 401, 404, 409, 503)
)
async def rotate_key(body: RotateKeyRequest, service: Service) -> KeyChange:
    """Make a new HPKE or signing key: pending until every replica has loaded it
    (``key_activation_seconds``), then in this shuffler's descriptor; an HPKE key it replaces
    still opens contributions through its overlap, a signing key it replaces names it in a
    succession the analyzer and devices follow. 409 ``rotation_pending``: a key of this kind
    is pending already; ``succession_limit``: the signing key rotated too often;
    ``key_timing``: ``hpke_overlap_seconds`` is too short for the longest epoch served now
    (one adopted from the analyzer's config: raise it). 503 ``key_storage_unavailable``: the
    key directory cannot be read or written."""
    return await asyncio.to_thread(_keys(service).rotate, body.key)


@admin.post(
    "/keys/retire", response_model=KeyChange, responses=error_responses(400, 401, 404, 409, 503)
)
async def retire_key(body: RetireKeyRequest, service: Service) -> KeyChange:
    """Retire an HPKE key now, before its overlap ends (one thought compromised): a
    contribution sealed to it gets 409 ``config_outdated`` from then on. 404 ``unknown_key``;
    409 ``key_in_use``: it is the published key or still pending (rotate first)."""
    return await asyncio.to_thread(_keys(service).retire, body.key_id)


@admin.post("/revoke", response_model=RevokeResult, responses=error_responses(400, 401, 503))
async def revoke(body: RevokeRequest, service: Service) -> RevokeResult:
    """Refuse a client's token from now on."""
    await asyncio.to_thread(service.revoke, body.client_id)
    return RevokeResult(revoked=body.client_id)


@admin.post("/requeue", response_model=RequeueResult, responses=error_responses(400, 401, 503))
async def requeue(body: RequeueRequest, service: Service) -> RequeueResult:
    """Send again the batch parts the analyzer refused (of ``batch_id``, or all), once what it
    refused them for is fixed; the forwarder takes them up within its interval. Unrequeued,
    retention purges such batches (``esa_shuffler_ledger_deleted{cause="refused"}``)."""
    return RequeueResult(requeued=await asyncio.to_thread(service.requeue, body.batch_id))
