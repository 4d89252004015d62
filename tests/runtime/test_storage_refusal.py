"""A database failure on any route is ``503 storage_unavailable`` with ``Retry-After``
(issue 49, fault 1: a client waits a database restart out instead of dropping its request),
in the one error shape, its message kept out of the answer."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from runtime.http import STORAGE_RETRY_SECONDS, install_error_handlers


def test_a_database_failure_answers_503_with_retry_after() -> None:
    app = FastAPI()
    install_error_handlers(app, logging.getLogger("test"), lambda _: None)

    @app.get("/fails")
    async def fails() -> None:
        raise OperationalError("SELECT secret_column", {"p": "a parameter"}, Exception("down"))

    answer = TestClient(app, raise_server_exceptions=False).get("/fails")
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == str(round(STORAGE_RETRY_SECONDS))
    assert answer.json() == {
        "error": "storage_unavailable",
        "detail": "the database is unavailable; nothing was stored",
    }
