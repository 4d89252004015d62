"""HTTP plumbing shared by the shuffler and the analyzer: one error shape, one set of
operational routes (``/healthz``, ``/readyz``, ``/metrics``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from common.wire import ErrorBody


class RejectedError(Exception):
    """A request a service refuses: HTTP status, error code and detail."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def error(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The one error shape: ``{"error": code, "detail": text}``."""
    return JSONResponse(ErrorBody(error=code, detail=detail).model_dump(), status, headers=headers)


def install_error_handlers(app: FastAPI, log: logging.Logger, count: Callable[[str], None]) -> None:
    """Refusals, invalid requests and storage failures become JSON errors (never a bare 500)."""

    @app.exception_handler(RejectedError)
    async def _rejected(_: Request, exc: RejectedError) -> JSONResponse:
        count(f"rejected_{exc.error}")
        return error(exc.status, exc.error, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "invalid_request", str(exc.errors()[:3]))

    @app.exception_handler(SQLAlchemyError)
    async def _storage(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.error("storage unavailable", extra={"error": type(exc).__name__})
        return error(503, "storage_unavailable", "the database is unavailable; nothing was stored")


def add_operational_routes(app: FastAPI, engine: Engine, registry: CollectorRegistry) -> None:
    """``/healthz`` (process up), ``/readyz`` (database answers), ``/metrics`` (Prometheus)."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        def ping() -> None:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        try:
            await asyncio.to_thread(ping)
        except SQLAlchemyError:
            return error(503, "not_ready", "database unreachable")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            generate_latest(registry).decode(), media_type="text/plain; version=0.0.4"
        )
