"""The analyzer app over a SQLite file, shared by the HTTP-level tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from analyzer.app import create_app

from .helpers import app_settings


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """The analyzer app of :func:`~tests.analyzer.helpers.app_settings`."""
    with TestClient(
        create_app(app_settings(tmp_path)), raise_server_exceptions=False
    ) as test_client:
        yield test_client
