"""HTTP at the edge, shared by the shuffler and the analyzer: one error shape, one table from
domain-error kinds to statuses, credential checks that run before anything reads the body, one
set of operational routes (``/healthz``, ``/readyz``, ``/metrics``) and an OpenAPI document
that lists every status each operation can answer.

Every non-2xx answer of every route is JSON ``{"error": code, "detail": sentence}``
(:class:`common.wire.ErrorBody`): domain refusals, unknown routes (404), wrong methods (405,
with ``Allow``), invalid bodies or parameters (400, the first problems in plain words, never a
Python repr; a body that is not UTF-8 JSON too), database failures (503) and unexpected
exceptions (500, logged with a traceback, answered with a fixed sentence so nothing internal
leaks). Answers the server gives itself — malformed HTTP framing (400), a request head or body
not arrived within its deadline (408) and an oversized request head (431) — come from
:mod:`runtime.server` in the same shape.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.wire import ErrorBody
from runtime.errors import DomainError, Kind, MetricsTokenError

#: The one table from what a refusal is to the status a client sees.
STATUS: dict[Kind, int] = {
    Kind.INVALID: 400,
    Kind.UNAUTHENTICATED: 401,
    Kind.FORBIDDEN: 403,
    Kind.NOT_FOUND: 404,
    Kind.CONFLICT: 409,
    Kind.TOO_LARGE: 413,
    Kind.UNSUPPORTED_MEDIA: 415,
    Kind.UNPROCESSABLE: 422,
    Kind.RATE_LIMITED: 429,
    Kind.UNAVAILABLE: 503,
}
#: Codes for errors raised by the framework rather than a core.
FRAMEWORK_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
}
#: Validation problems named in one 400 answer.
MAX_PROBLEMS = 3

_DESCRIPTIONS = {
    400: "Malformed request: an invalid body or parameter, or (answered before routing) "
    "malformed HTTP framing; detail names the problem",
    401: "Missing, forged or revoked credentials",
    403: "Authenticated but not allowed",
    404: "Unknown route or resource",
    405: "Method not allowed on this route (Allow lists the methods)",
    408: "The request head or body did not arrive within the server's deadline, or the body "
    "arrived below its minimum rate (head_timeout, body_timeout; answered by the server, "
    "connection closed)",
    409: "Conflicts with what is already stored",
    413: "Body over the size limit",
    415: "Unsupported Content-Type",
    422: "Well-formed but inconsistent with the configuration",
    429: "Too many requests; Retry-After says when to come back",
    431: "Request line and headers over the server's head limit (answered before routing)",
    500: "Unexpected server error (logged; nothing internal in the answer)",
    503: "Database unavailable; nothing was stored",
}
_HEADERS: dict[int, dict[str, Any]] = {
    429: {
        "Retry-After": {
            "description": "Whole seconds to wait before retrying",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        }
    },
    503: {
        "Retry-After": {
            "description": "Whole seconds to wait before retrying (storage_unavailable, "
            "key_not_loaded)",
            "required": False,
            "schema": {"type": "integer", "minimum": 1},
        }
    },
}
#: Statuses every operation may answer whatever its route: the server's own refusals
#: (malformed framing, a head or body not arrived in time, an oversized head) and an
#: unexpected error.
SERVER_STATUSES = (400, 408, 431, 500)


#: The detail of every 500: the failure itself is in the service's log, never in the answer.
INTERNAL_DETAIL = "unexpected server error; it has been logged"
#: ``Retry-After`` (seconds) of a ``503 storage_unavailable``: the database did not answer or
#: commit (restarting, unreachable, full), so the client asks again shortly.
STORAGE_RETRY_SECONDS = 1.0


def _documented(status: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "model": ErrorBody,
        "description": _DESCRIPTIONS.get(status, "Refused"),
    }
    if status in _HEADERS:
        entry["headers"] = _HEADERS[status]
    return entry


#: ``responses=`` documenting the error shape under the common statuses (the analyzer's app).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: _documented(status) for status in (400, 401, 404, 405, 500, 503)
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for one route: the error shape (and headers such as ``Retry-After``)
    under each status it may answer."""
    return {status: _documented(status) for status in statuses}


def status_of(error: DomainError) -> int:
    """The HTTP status of a domain error."""
    return STATUS[error.kind]


def error_body(code: str, detail: str) -> bytes:
    """The exact bytes of an error answer (for raw ASGI paths that bypass FastAPI)."""
    return ErrorBody(error=code, detail=detail).model_dump_json().encode()


def error_response(
    status: int,
    code: str,
    detail: str,
    retry_after: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The one error shape: ``{"error": code, "detail": text}`` (with ``Retry-After``)."""
    extra = dict(headers or {})
    if retry_after is not None:
        extra["Retry-After"] = str(max(1, round(retry_after)))
    body = ErrorBody(error=code, detail=detail).model_dump()
    return JSONResponse(body, status, headers=extra or None)


def domain_response(error: DomainError) -> JSONResponse:
    """A domain error as the client sees it."""
    return error_response(status_of(error), error.code, error.detail, error.retry_after)


def describe_validation(errors: Sequence[Any]) -> str:
    """Validation problems as one sentence: ``where: what`` for the first few, no repr."""
    parts = []
    for problem in list(errors)[:MAX_PROBLEMS]:
        if problem.get("type") == "json_invalid":
            parts.append("body: not valid JSON")
            continue
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {problem.get('msg', 'invalid')}")
    more = len(errors) - MAX_PROBLEMS
    suffix = f" (and {more} more)" if more > 0 else ""
    return "invalid request: " + "; ".join(parts) + suffix


#: ``refused(route, code)``: a refusal by a FastAPI route (its path template and error code).
Refused = Callable[[str, str], None]


def route_of(request: Request) -> str:
    """The path template of the route that answered (bounded: never the raw URL)."""
    route = request.scope.get("route")
    return str(getattr(route, "path", "unmatched"))


def install_error_handlers(
    app: FastAPI,
    log: logging.Logger,
    count: Callable[[str], None],
    refused: Refused | None = None,
) -> None:
    """Map every failure to the one error shape.

    Refusals are reported to ``refused(route, code)`` when given (so a service can count them
    per route), else to ``count("rejected_<code>")``.
    """

    def note(request: Request, code: str) -> None:
        if refused is not None:
            refused(route_of(request), code)
        else:
            count(f"rejected_{code}")

    @app.exception_handler(DomainError)
    async def _domain(request: Request, exc: DomainError) -> JSONResponse:
        note(request, exc.code)
        return domain_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = FRAMEWORK_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 400:
            note(request, code)
        return error_response(exc.status_code, code, _framework_detail(exc), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        note(request, "invalid_request")
        return error_response(400, "invalid_request", describe_validation(exc.errors()))

    _install_failure_handlers(app, log)


def _install_failure_handlers(app: FastAPI, log: logging.Logger) -> None:
    @app.exception_handler(SQLAlchemyError)
    async def _storage(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.error("storage unavailable", extra={"error": type(exc).__name__})
        return error_response(
            503,
            "storage_unavailable",
            "the database is unavailable; nothing was stored",
            retry_after=STORAGE_RETRY_SECONDS,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", extra={"route": request.url.path})
        return error_response(500, "internal", INTERNAL_DETAIL)


def _framework_detail(exc: StarletteHTTPException) -> str:
    if exc.status_code == 400:  # FastAPI could not read the body as JSON (e.g. not UTF-8)
        return "invalid request: body: not valid UTF-8 JSON"
    if exc.status_code == 404:
        return "no such route"
    if exc.status_code == 405:
        return "method not allowed on this route"
    return str(exc.detail)


# --- credentials ------------------------------------------------------------------------------


def bearer_matches(header: str | None, secret: str) -> bool:
    """True when ``header`` is ``Bearer <secret>``: the scheme in any case, then one or more
    spaces (RFC 9110 §11.4, ``credentials = auth-scheme [ 1*SP token68 ]``; RFC 6750 §2.1),
    the secret compared in constant time (any bytes are just wrong, never an error)."""
    scheme, _, credentials = (header or "").partition(" ")
    supplied = credentials.lstrip(" ").encode("utf-8", "surrogateescape")
    bearer = scheme.lower() == "bearer"
    return bool(secret) and hmac.compare_digest(supplied, secret.encode()) and bearer


#: A check on a request before FastAPI reads its body; raises a :class:`DomainError` to refuse.
Check = Callable[[Request], None]


def bearer_check(
    secret: Callable[[Request], str], error: Callable[[str], DomainError], detail: str
) -> Check:
    """A :data:`Check` that refuses with ``error(detail)`` unless the request carries
    ``Authorization: Bearer <secret(request)>``."""

    def check(request: Request) -> None:
        if not bearer_matches(request.headers.get("authorization"), secret(request)):
            raise error(detail)

    return check


def checked_route(*checks: Check) -> type[APIRoute]:
    """A route class whose routes run ``checks`` first — before FastAPI reads, parses or
    validates the body, and before any dependency — so a request without credentials is a 401
    whatever its body (the answer the app's error handlers give, like every other refusal).

    Use as ``APIRouter(route_class=checked_route(...))``; document the credential with
    :func:`bearer_scheme` in the router's dependencies.
    """

    class CheckedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                for check in checks:
                    check(request)
                return await handler(request)

            return checked

    return CheckedRoute


def bearer_scheme(name: str, description: str) -> Any:
    """A dependency that only documents a bearer credential in the OpenAPI (``security``);
    the check itself is a :func:`bearer_check` run by :func:`checked_route` (or the route)."""
    return Security(HTTPBearer(scheme_name=name, description=description, auto_error=False))


# --- OpenAPI ----------------------------------------------------------------------------------


def document_errors(
    app: FastAPI,
    refine: Callable[[dict[str, Any]], None] | None = None,
    add: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Make ``app``'s OpenAPI the truth about errors: drop FastAPI's automatic 422 (invalid
    input is answered 400 here, and documented so), give every operation the
    :data:`SERVER_STATUSES` any request can get, and every error status the JSON
    ``{"error", "detail"}`` schema (FastAPI would label a text route's errors with its own
    media type). ``add`` first adds operations no route declares (answered before routing:
    the CORS preflights of :func:`runtime.cors.document_preflights`); ``refine`` then states
    what only the running instance knows (its configured channels, say)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            built = build()
            if add is not None:
                add(built)
            schema = _truthful(built)
            if refine is not None:
                refine(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _truthful(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("ErrorBody", ErrorBody.model_json_schema())
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if responses.get("422", {}).get("description") == "Validation Error":
                del responses["422"]
            for status in SERVER_STATUSES:
                responses.setdefault(str(status), {"description": _DESCRIPTIONS[status]})
            for status, answer in responses.items():
                if int(status) >= 400:  # FastAPI labels a text route's errors text/plain
                    answer["content"] = dict(error)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


# --- operational routes -----------------------------------------------------------------------


def add_operational_routes(
    app: FastAPI, engine: Engine, registry: CollectorRegistry, metrics_token: str | None = None
) -> None:
    """``/healthz`` (process up), ``/readyz`` (database answers), ``/metrics`` (Prometheus;
    with ``metrics_token``, only for ``Authorization: Bearer <metrics_token>``: a shuffler's
    exact pending, held and deleted counts would undo randomized deletion: docs/protocol.md,
    "What never leaves a party")."""

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses=error_responses(503))
    async def readyz() -> JSONResponse:
        def ping() -> None:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        try:
            await asyncio.to_thread(ping)
        except SQLAlchemyError:
            return error_response(503, "not_ready", "database unreachable")
        return JSONResponse({"status": "ready"})

    _add_metrics_route(app, registry, metrics_token)


def _add_metrics_route(
    app: FastAPI, registry: CollectorRegistry, metrics_token: str | None
) -> None:
    guarded = metrics_token is not None
    described = "the metrics bearer token (secret counts: docs/protocol.md)"
    text_plain = {"text/plain": {"schema": {"type": "string"}}}

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus text format 0.0.4", "content": text_plain},
            **(error_responses(401) if guarded else {}),
        },
        dependencies=[bearer_scheme("MetricsToken", described)] if guarded else [],
    )
    async def metrics(request: Request) -> Response:
        if metrics_token is not None and not bearer_matches(
            request.headers.get("authorization"), metrics_token
        ):
            raise MetricsTokenError("/metrics needs Authorization: Bearer <metrics token>")
        # In a thread: collectors read the database, which must not stall the event loop.
        body = await asyncio.to_thread(generate_latest, registry)
        return PlainTextResponse(body.decode(), media_type="text/plain; version=0.0.4")
