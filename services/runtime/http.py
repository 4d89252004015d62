"""HTTP at the edge, shared by the shuffler and the analyzer: one error shape, one table from
domain-error kinds to statuses, and one set of operational routes (``/healthz``, ``/readyz``,
``/metrics``).

Every non-2xx answer of every route is JSON ``{"error": code, "detail": sentence}``
(:class:`common.wire.ErrorBody`): domain refusals, unknown routes (404), wrong methods (405),
invalid bodies or parameters (400, the first problems in plain words, never a Python repr),
database failures (503) and unexpected exceptions (500, logged with a traceback, answered with
a fixed sentence so nothing internal leaks).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.wire import ErrorBody
from services.runtime.errors import DomainError, Kind, MetricsTokenError

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
FRAMEWORK_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}
#: Validation problems named in one 400 answer.
MAX_PROBLEMS = 3

_DESCRIPTIONS = {
    400: "Malformed request (detail names the field)",
    401: "Missing, forged or revoked credentials",
    404: "Unknown route or resource",
    405: "Method not allowed on this route",
    500: "Unexpected server error (logged; nothing internal in the answer)",
    503: "Database unavailable; nothing was stored",
}
#: ``responses=`` for every app: the error shape documented in the OpenAPI for every route.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in _DESCRIPTIONS.items()
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for one route: the error shape under each extra status it may answer."""
    return {status: {"model": ErrorBody, "description": "Refused"} for status in statuses}


def status_of(error: DomainError) -> int:
    """The HTTP status of a domain error."""
    return STATUS[error.kind]


def error_body(code: str, detail: str) -> bytes:
    """The exact bytes of an error answer (for raw ASGI paths that bypass FastAPI)."""
    return ErrorBody(error=code, detail=detail).model_dump_json().encode()


def error_response(
    status: int, code: str, detail: str, retry_after: float | None = None
) -> JSONResponse:
    """The one error shape: ``{"error": code, "detail": text}`` (with ``Retry-After``)."""
    headers = None if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return JSONResponse(ErrorBody(error=code, detail=detail).model_dump(), status, headers=headers)


def domain_response(error: DomainError) -> JSONResponse:
    """A domain error as the client sees it."""
    return error_response(status_of(error), error.code, error.detail, error.retry_after)


def describe_validation(errors: Sequence[Any]) -> str:
    """Validation problems as one sentence: ``where: what`` for the first few, no repr."""
    parts = []
    for problem in list(errors)[:MAX_PROBLEMS]:
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {problem.get('msg', 'invalid')}")
    more = len(errors) - MAX_PROBLEMS
    suffix = f" (and {more} more)" if more > 0 else ""
    return "invalid request: " + "; ".join(parts) + suffix


def install_error_handlers(app: FastAPI, log: logging.Logger, count: Callable[[str], None]) -> None:
    """Map every failure to the one error shape; ``count`` sees ``rejected_<code>``."""

    @app.exception_handler(DomainError)
    async def _domain(_: Request, exc: DomainError) -> JSONResponse:
        count(f"rejected_{exc.code}")
        return domain_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = FRAMEWORK_CODES.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, _framework_detail(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        count("rejected_invalid_request")
        return error_response(400, "invalid_request", describe_validation(exc.errors()))

    @app.exception_handler(SQLAlchemyError)
    async def _storage(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.error("storage unavailable", extra={"error": type(exc).__name__})
        return error_response(
            503, "storage_unavailable", "the database is unavailable; nothing was stored"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", extra={"route": request.url.path})
        return error_response(500, "internal", "unexpected server error; it has been logged")


def _framework_detail(exc: StarletteHTTPException) -> str:
    if exc.status_code == 404:
        return "no such route"
    if exc.status_code == 405:
        return "method not allowed on this route"
    return str(exc.detail)


def bearer_matches(header: str | None, secret: str) -> bool:
    """True when ``header`` is ``Bearer <secret>`` (constant time; any bytes are just wrong)."""
    expected = f"Bearer {secret}".encode()
    supplied = (header or "").encode("utf-8", "surrogateescape")
    return bool(secret) and hmac.compare_digest(supplied, expected)


def add_operational_routes(
    app: FastAPI, engine: Engine, registry: CollectorRegistry, metrics_token: str | None = None
) -> None:
    """``/healthz`` (process up), ``/readyz`` (database answers), ``/metrics`` (Prometheus;
    with ``metrics_token``, only for ``Authorization: Bearer <metrics_token>``: a shuffler's
    exact pending, held and deleted counts would undo randomized deletion — PROTOCOL.md)."""

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

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {}}}, **error_responses(401)},
    )
    async def metrics(request: Request) -> Response:
        if metrics_token is not None and not bearer_matches(
            request.headers.get("authorization"), metrics_token
        ):
            raise MetricsTokenError("/metrics needs Authorization: Bearer <metrics token>")
        return PlainTextResponse(
            generate_latest(registry).decode(), media_type="text/plain; version=0.0.4"
        )
