"""The analyzer's HTTP API: thin routers over :class:`analyzer.service.AnalyzerService`.

Batch intake (``POST /v1/batches``), the signed config, channels, estimates, releases, privacy,
LDP-SGD training (ESA-revisited Algorithm 5), the dashboard and the operational routes. Every
non-2xx answer is JSON ``{"error", "detail"}`` (:mod:`runtime.http`), and the OpenAPI states
every status each route answers. Cheap refusals come before expensive work: sender, signature
header, declared length and content type are checked before a batch's body is read, the body is
streamed under the cap and verified before it is parsed, and admin routes check the bearer
token before their body.

The routes and their answers: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect

from analyzer import dashboard
from analyzer.errors import (
    AdminTokenError,
    BadPreauthError,
    BatchTooLargeError,
    IncompleteBodyError,
    MalformedBatchError,
    UnknownChannelError,
    UnsupportedMediaTypeError,
)
from analyzer.intake import MAX_STORED_INT, SIGNATURE_BYTES, signature_bytes
from analyzer.metrics import EventsCollector
from analyzer.service import AnalyzerService
from analyzer.settings import AnalyzerSettings
from analyzer.slots import IntakeSlots
from analyzer.training import StepResult, Trainer, TrainingBody, step_result, training_body
from common.preauth import PREAUTH_PATTERN, PREAUTH_WINDOW_SECONDS, PreauthError
from common.wire import (
    IDENTIFIER,
    MAX_INT,
    Batch,
    BatchAck,
    ChannelChange,
    ChannelConfig,
    ChannelList,
    EpochCloseRequest,
    EpochsClosed,
    KeyChange,
    KeyList,
    Ledger,
    PrivacyOverview,
    ReleaseBody,
    ReleaseRequest,
    RequeueRequest,
    RequeueResult,
    RetireKeyRequest,
    RotateKeyRequest,
    SignedConfig,
)
from runtime import logs
from runtime.cors import Cors, DeviceRoute, document_preflights, install_cors
from runtime.deadlines import ReadGuard
from runtime.http import (
    add_operational_routes,
    bearer_check,
    bearer_scheme,
    checked_route,
    document_errors,
    error_responses,
    install_error_handlers,
)

log = logging.getLogger("esa.analyzer")


def batch_schema() -> dict[str, Any]:
    """The JSON schema of a batch part as this edge accepts it: :class:`common.wire.Batch` with
    the bounds :func:`analyzer.intake.BatchIntake.accept` adds (what the tables hold)."""
    schema = Batch.model_json_schema()
    fields = schema["properties"]
    fields["part"]["maximum"] = MAX_STORED_INT - 1
    for name in ("parts", "n_contributions"):
        fields[name]["maximum"] = MAX_STORED_INT
    return schema


#: ``ESA-Signature``: standard base64 of a 64-byte Ed25519 signature (86 characters and "==").
SIGNATURE_PATTERN = r"^[A-Za-z0-9+/]{86}==$"
#: What ``POST /v1/batches`` reads: its body is read raw (the signature covers the exact
#: bytes), so the OpenAPI document states it by hand.
BATCH_REQUEST: dict[str, Any] = {
    "parameters": [
        {
            "name": "ESA-Shuffler",
            "in": "header",
            "required": True,
            "description": "the id of the registered shuffler that signed the body (its key is "
            "looked up, and the body refused unread if it is unknown)",
            "schema": {"type": "string", "pattern": IDENTIFIER.pattern},
        },
        {
            "name": "ESA-Preauth",
            "in": "header",
            "required": True,
            "description": "the shuffler's signed head, checked before the body is read: "
            "<timestamp>.<body length>.<body SHA-256 hex>.<base64 Ed25519 signature over "
            "esa-preauth-v1, the shuffler id, length, digest and timestamp> (docs/protocol-notes"
            '.md, "Batch intake: pre-authentication and deadlines"); good '
            f"{PREAUTH_WINDOW_SECONDS} s either side of the analyzer's clock",
            "schema": {"type": "string", "pattern": PREAUTH_PATTERN},
        },
        {
            "name": "ESA-Signature",
            "in": "header",
            "required": True,
            "description": f"base64 Ed25519 signature ({SIGNATURE_BYTES} bytes) of the exact "
            "body by the shuffler it names",
            "schema": {"type": "string", "pattern": SIGNATURE_PATTERN},
        },
    ],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": batch_schema()}},
    },
}
#: Answered on every path: a method it does not serve (405, with ``Allow``); the server-level
#: 400, 408, 431 and 500 are added by :func:`runtime.http.document_errors`.
EVERY_ROUTE = (405,)
#: What a device fetches here: the only route a web page of an allowed origin may call
#: (:mod:`runtime.cors`).
DEVICE_ROUTES = {"/v1/config": DeviceRoute(("GET",))}
#: The OpenAPI description: what no single operation says.
DESCRIPTION = (
    'Every answer other than 2xx is JSON `{"error": code, "detail": sentence}`. Only '
    "`GET /v1/config` answers a web page of an origin in `ESA_ANALYZER_CORS_ORIGINS` (none by "
    "default): a CORS preflight (`OPTIONS` with `Access-Control-Request-Method`) to any other "
    "path is 403 `cors_route_refused`."
)


def get_service(request: Request) -> AnalyzerService:
    """The application's analyzer service (a FastAPI dependency)."""
    service: AnalyzerService = request.app.state.service
    return service


Service = Annotated[AnalyzerService, Depends(get_service)]


def _admin_secret(request: Request) -> str:
    return get_service(request).settings.admin_token.get_secret_value()


#: Admin routes need ``Authorization: Bearer <admin token>``, checked before FastAPI reads,
#: parses or validates the body (a malformed body without the token is a 401, not a 400).
require_admin = bearer_check(
    _admin_secret, AdminTokenError, "Authorization: Bearer <admin token> required"
)


def check_declared_length(request: Request, cap: int) -> None:
    """Refuse a body whose declared ``Content-Length`` is over ``cap`` before reading it.

    Raises:
        BatchTooLargeError: ``Content-Length`` over ``cap``.
        MalformedBatchError: ``Content-Length`` is not a number.
    """
    declared = request.headers.get("content-length")
    if declared is None:
        return
    length = declared.strip()
    if not (length.isascii() and length.isdigit()):
        raise MalformedBatchError("Content-Length must be a number of bytes")
    if int(length) > cap:
        raise BatchTooLargeError(f"batch part of {int(length)} bytes exceeds {cap} bytes")


async def capped_body(request: Request, cap: int) -> bytes:
    """The request body, streamed and refused as soon as it exceeds ``cap`` bytes (at most one
    chunk is held beyond the cap; a chunked body declares no length).

    Raises:
        BatchTooLargeError: the body is over ``cap`` bytes.
        IncompleteBodyError: the connection ended before the body did.
    """
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise BatchTooLargeError(f"batch part exceeds {cap} bytes")
    except ClientDisconnect as gone:  # the client left, or the server's body deadline cut it
        raise IncompleteBodyError("the connection closed before the body ended") from gone
    return bytes(body)


def require_json(content_type: str | None) -> None:
    """A batch is JSON: a missing ``Content-Type`` is read as JSON, another type is a 415."""
    media = (content_type or "application/json").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {media!r}")


batches = APIRouter(tags=["batches"])
channels = APIRouter(prefix="/v1/channels", tags=["channels"])
admin = APIRouter(
    prefix="/v1/channels",
    tags=["channels"],
    route_class=checked_route(require_admin),
    dependencies=[bearer_scheme("AdminToken", "the analyzer's admin token")],
)
operations = APIRouter(
    prefix="/v1/admin",
    tags=["admin"],
    route_class=checked_route(require_admin),
    dependencies=[bearer_scheme("AdminToken", "the analyzer's admin token")],
)
pages = APIRouter(tags=["dashboard"])


@batches.post(
    "/v1/batches",
    status_code=201,
    response_model=BatchAck,
    response_model_exclude_none=True,
    responses={
        200: {"model": BatchAck, "description": "Known (batch_id, part) (counted once)"},
        **error_responses(400, 401, 413, 415, 422, 503),
    },
    openapi_extra=BATCH_REQUEST,
)
async def post_batch(request: Request, response: Response, service: Service) -> BatchAck:
    """Store one signed part of a batch from a registered shuffler (opened later): the sender,
    the signature's form and the shuffler's signed ``ESA-Preauth`` (:mod:`common.preauth`) are
    checked before the body is read (in one of the sender's intake slots,
    :class:`analyzer.slots.IntakeSlots`, so only the shuffler itself takes one), the body
    against ``ESA-Preauth`` and then its signature before it is parsed. 401 ``bad_preauth``:
    that header missing, malformed, more than its window from this analyzer's clock, not
    signed by the shuffler, or naming another body.
    422 ``future_epoch``: its epoch starts more than ``epoch_skew_seconds`` after this
    analyzer's clock (a batch is sent once its epoch closed)."""
    sender, signature = request.headers.get("esa-shuffler"), request.headers.get("esa-signature")
    service.intake.sender(sender)
    signature_bytes(signature)
    cap = service.intake.policy.max_batch_bytes
    check_declared_length(request, cap)
    require_json(request.headers.get("content-type"))
    preauth = await asyncio.to_thread(
        service.intake.preauthorize, str(sender), request.headers.get("esa-preauth"), cap
    )
    slots: IntakeSlots = request.app.state.intake_slots
    with slots.slot(str(sender)):  # only the shuffler itself gets here
        body = await capped_body(request, cap)
        try:
            preauth.check_body(body)
        except PreauthError as error:
            raise BadPreauthError(str(error)) from error
        ack = await asyncio.to_thread(service.accept, body, signature, sender)
    if ack.duplicate:
        response.status_code = 200
    return ack


@batches.get("/v1/config", response_model=SignedConfig, responses=error_responses(503))
async def get_config(service: Service) -> SignedConfig:
    """The signed collection config devices fetch (503 ``shufflers_unavailable`` until every
    registered shuffler's own signed descriptor is known)."""
    return service.config()


@channels.get("", response_model=ChannelList, responses=error_responses(503))
async def list_channels(service: Service) -> ChannelList:
    """Configured channels and the epochs received so far."""
    return await asyncio.to_thread(service.channels)


@channels.get(
    "/{channel_id}/estimate", response_model=ReleaseBody, responses=error_responses(400, 404, 503)
)
async def get_estimate(
    service: Service,
    channel_id: str,
    epoch: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    epoch_from: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    epoch_to: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    top: Annotated[int | None, Query(ge=1, le=MAX_INT)] = None,
) -> ReleaseBody:
    """A release over ``epoch`` or ``[epoch_from, epoch_to]`` (default: the last settled
    epoch), over settled epochs only: every shuffler delivered, or closed at the analyzer's
    ``epoch_close_seconds`` after the epoch's end. 404 ``epoch_open`` while none in range is."""
    return await asyncio.to_thread(service.estimate, channel_id, epoch, epoch_from, epoch_to, top)


@admin.post(
    "/{channel_id}/releases",
    status_code=201,
    response_model=ReleaseBody,
    responses=error_responses(400, 401, 404, 503),
)
async def post_release(
    service: Service, channel_id: str, request: Annotated[ReleaseRequest | None, Body()] = None
) -> ReleaseBody:
    """Publish a release over the requested epochs (default: the last settled one) and record
    it; 404 ``epoch_open`` while none in range is settled."""
    wanted = request or ReleaseRequest()
    return await asyncio.to_thread(service.publish, channel_id, wanted)


def _trainer(service: AnalyzerService, channel_id: str) -> Trainer:
    if service.trainer is None:
        raise UnknownChannelError(f"channel {channel_id[:64]!r} is not a training channel")
    return service.trainer


@admin.post(
    "/{channel_id}/training/step",
    response_model=StepResult,
    responses=error_responses(401, 404, 503),
)
async def post_training_step(
    service: Service,
    channel_id: str,
    epoch_to: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
) -> StepResult:
    """One LDP-SGD step (ESA-revisited Algorithm 5, lines 4–6) from the epochs received since
    the previous step, up to ``epoch_to`` (default: the last received): θ_{t+1} from the
    reports of round t, reports naming another round refused and counted; the signed config
    publishes θ_{t+1} and round t+1 from now on. 404 ``no_data`` when no report of round t
    was received (nothing changes)."""
    trainer = _trainer(service, channel_id)
    return await asyncio.to_thread(step_result, trainer, channel_id, epoch_to)


@channels.get("/{channel_id}/training", response_model=TrainingBody, responses=error_responses(404))
async def get_training(service: Service, channel_id: str) -> TrainingBody:
    """A training channel's training (its mechanism offers the facet; LDP-SGD): the current
    round, θ_t and every step taken."""
    trainer = _trainer(service, channel_id)
    return await asyncio.to_thread(training_body, trainer, channel_id)


@channels.get("/{channel_id}/privacy", response_model=Ledger, responses=error_responses(404, 503))
async def get_privacy(service: Service, channel_id: str) -> Ledger:
    """The channel's privacy ledger: each epoch's certificate and the lifetime ε."""
    return await asyncio.to_thread(service.privacy, channel_id)


@batches.get("/v1/privacy", response_model=PrivacyOverview, responses=error_responses(503))
async def get_lifetime(service: Service) -> PrivacyOverview:
    """The lifetime ε of a device that took part in every channel."""
    return await asyncio.to_thread(service.lifetime)


@operations.post("/requeue", response_model=RequeueResult, responses=error_responses(400, 401, 503))
async def requeue(service: Service, body: RequeueRequest) -> RequeueResult:
    """Open again the batch parts quarantined after failed openings (of ``batch_id``, or all),
    once their cause is fixed (a key restored, storage repaired)."""
    return RequeueResult(requeued=await asyncio.to_thread(service.requeue, body.batch_id))


@operations.get("/keys", response_model=KeyList, responses=error_responses(401, 503))
async def list_keys(service: Service) -> KeyList:
    """The analyzer's keys (HPKE and config-signing): state, times, which one is published,
    and the successions its signing keys made."""
    return await asyncio.to_thread(service.keys.listing)


@operations.post(
    "/keys/rotate", response_model=KeyChange, responses=error_responses(400, 401, 409, 503)
)
async def rotate_key(service: Service, body: RotateKeyRequest) -> KeyChange:
    """Make a new HPKE or config-signing key: pending until every worker has loaded it
    (``key_activation_seconds``), then published; an HPKE key it replaces still opens through
    its overlap, a signing key it replaces names it in a succession devices follow. 409
    ``rotation_pending``: a key of this kind is pending already; ``succession_limit``: the
    signing key rotated too often; ``key_timing``: ``hpke_overlap_seconds`` is too short for
    the longest epoch served now (raise it). 503 ``key_storage_unavailable``: the key directory
    cannot be read or written."""
    return await asyncio.to_thread(service.keys.rotate, body.key)


@operations.post(
    "/keys/retire", response_model=KeyChange, responses=error_responses(400, 401, 404, 409, 503)
)
async def retire_key(service: Service, body: RetireKeyRequest) -> KeyChange:
    """Retire an HPKE key now, before its overlap ends (one thought compromised): fragments
    sealed to it no longer open. 404 ``unknown_key``; 409 ``key_in_use``: it is the published
    key or still pending (rotate first)."""
    return await asyncio.to_thread(service.keys.retire, body.key_id)


@operations.post(
    "/channels",
    status_code=201,
    response_model=ChannelChange,
    responses={
        200: {"model": ChannelChange, "description": "The same channel exists: no change"},
        **error_responses(400, 401, 409, 503),
    },
)
async def add_channel(service: Service, response: Response, body: ChannelConfig) -> ChannelChange:
    """Add a channel while running: published in the next signed config (a new revision),
    picked up by shufflers and devices from it. 409 ``channel_exists``: its id names a
    channel with other parameters (a live channel's parameters never change)."""
    change = await asyncio.to_thread(service.add_channel, body)
    if not change.changed:
        response.status_code = 200
    return change


@operations.post(
    "/channels/{channel_id}/retire",
    response_model=ChannelChange,
    responses=error_responses(401, 404, 503),
)
async def retire_channel(service: Service, channel_id: str) -> ChannelChange:
    """Retire a channel: shufflers refuse its contributions from its next epoch on
    (``409 channel_retired``); its releases and ledger stay. Retiring again changes nothing."""
    return await asyncio.to_thread(service.retire_channel, channel_id)


@operations.post(
    "/channels/{channel_id}/close",
    response_model=EpochsClosed,
    responses=error_responses(400, 401, 404, 503),
)
async def close_epochs(service: Service, channel_id: str, body: EpochCloseRequest) -> EpochsClosed:
    """Close every epoch of the channel up to ``epoch`` now, as its close timeout
    (``epoch_close_seconds`` after its end) would: its releases rest on the batches complete
    now, never on one completing later (a group with a part still waiting for the opener stays
    open). For an operator whose shufflers have forwarded everything (``esa loadtest``, the
    demo); closing again changes nothing."""
    return await asyncio.to_thread(service.close_epochs, channel_id, body)


@pages.get("/", response_class=HTMLResponse, responses=error_responses(503))
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

    app = FastAPI(
        title="ESA analyzer",
        description=DESCRIPTION,
        lifespan=lifespan,
        responses=error_responses(*EVERY_ROUTE),
        redirect_slashes=False,
    )
    app.state.service = service
    app.state.intake_slots = IntakeSlots(settings.intake_slots_per_shuffler)
    app.state.read_guard = ReadGuard(settings.read_deadlines(), service.events.count)
    install_error_handlers(app, log, service.events.count)
    cors = Cors(settings.allowed_origins, DEVICE_ROUTES)
    install_cors(app, cors, lambda _route, code: service.events.count(f"rejected_{code}"))
    document_errors(app, add=document_preflights(cors))
    for router in (batches, channels, admin, operations, pages):
        app.include_router(router)
    metrics = CollectorRegistry(auto_describe=True)
    ledger = functools.partial(service.store.fragment_ledger, service.catalog.table)
    store = service.store
    metrics.register(
        EventsCollector(service.events, store.unopened_parts, ledger, store.channel_health)
    )
    token = settings.metrics_token
    add_operational_routes(
        app, service.store.engine, metrics, None if token is None else token.get_secret_value()
    )
    return app
