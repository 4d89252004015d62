"""An analyzer a browser can reach: ``GET /v1/config`` (what a device fetches) answers a page of
an allowed origin; batches, admin, releases, metrics and the dashboard never do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from analyzer.app import DEVICE_ROUTES, create_app

from .helpers import app_settings

PAGE = "https://app.example.com"
ADMIN = {"Authorization": "Bearer development"}
#: Routes no page may call, answered 2xx (given the admin token where they need it).
OTHERS = [
    ("GET", "/v1/channels"),
    ("GET", "/v1/privacy"),
    ("GET", "/v1/admin/keys"),
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    ("GET", "/"),
    ("GET", "/openapi.json"),
]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = app_settings(tmp_path).model_copy(update={"cors_origins": PAGE})
    with TestClient(create_app(settings), raise_server_exceptions=False) as started:
        yield started


def _cors_headers(answer: httpx.Response) -> list[str]:
    return [name for name in answer.headers if name.startswith("access-control-")]


def test_the_config_is_the_only_device_route() -> None:
    assert set(DEVICE_ROUTES) == {"/v1/config"} and DEVICE_ROUTES["/v1/config"].headers == ()


def test_a_page_of_an_allowed_origin_fetches_the_config(client: TestClient) -> None:
    fetched = client.get("/v1/config", headers={"Origin": PAGE})
    assert fetched.status_code == 200 and fetched.json()["config"]
    assert fetched.headers["access-control-allow-origin"] == PAGE
    assert fetched.headers["access-control-expose-headers"] == "Retry-After"
    assert fetched.headers["vary"] == "Origin"
    asked = {"Origin": PAGE, "Access-Control-Request-Method": "GET"}
    preflight = client.options("/v1/config", headers=asked)
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-methods"] == "GET"
    refused = client.options(
        "/v1/config", headers={**asked, "Access-Control-Request-Headers": "authorization"}
    )
    assert refused.status_code == 403 and refused.json()["error"] == "cors_headers_refused"


def test_another_origin_gets_nothing(client: TestClient) -> None:
    other = {"Origin": "https://evil.example"}
    fetched = client.get("/v1/config", headers=other)
    assert fetched.status_code == 200 and not _cors_headers(fetched)
    asked = {**other, "Access-Control-Request-Method": "GET"}
    refused = client.options("/v1/config", headers=asked)
    assert refused.status_code == 403 and refused.json()["error"] == "cors_origin_refused"


@pytest.mark.parametrize(("method", "path"), OTHERS)
def test_no_other_route_ever_answers_a_page(client: TestClient, method: str, path: str) -> None:
    answer = client.request(method, path, headers={"Origin": PAGE, **ADMIN})
    assert answer.status_code < 300, answer.text
    assert not _cors_headers(answer) and "vary" not in answer.headers
    asked = {"Origin": PAGE, "Access-Control-Request-Method": method}
    refused = client.options(path, headers=asked)
    assert refused.status_code == 403 and refused.json()["error"] == "cors_route_refused"


def test_batches_never_answer_a_page(client: TestClient) -> None:
    """The shufflers' intake: refused as ever, with no grant, and so is its preflight."""
    sent = client.post("/v1/batches", content=b"{}", headers={"Origin": PAGE})
    assert sent.status_code == 401 and not _cors_headers(sent)
    asked = {"Origin": PAGE, "Access-Control-Request-Method": "POST"}
    assert client.options("/v1/batches", headers=asked).json()["error"] == "cors_route_refused"
