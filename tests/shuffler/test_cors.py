"""A shuffler a browser can reach: its device routes (contributions, enroll, descriptor) answer
a page of an allowed origin, on the ingest fast path too (the services' own HTTP server, no
middleware in the way); admin, metrics, config and every other route never do."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from runtime.cors import MAX_AGE
from shuffler.app import create_asgi
from shuffler.ingest import ROUTE, Ingest, IngestFastPath
from shuffler.routes import DEVICE_ROUTES
from shuffler.settings import ShufflerSettings

from ..support import served
from .factory import POLICY

PAGE = "http://127.0.0.1:8000"
ADMIN = {"Authorization": "Bearer development"}
GRANT = {"access-control-allow-origin": PAGE, "access-control-expose-headers": "Retry-After"}
#: Routes no page may call, each with a request that is answered 2xx given the admin token.
OTHERS = [
    ("GET", "/v1/config"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/v1/admin/keys"),
    ("POST", "/v1/admin/requeue"),
    ("GET", "/openapi.json"),
]


def _app(tmp_path: Path, origins: str = PAGE, **settings: Any) -> IngestFastPath:
    return create_asgi(
        ShufflerSettings(
            database_url=f"sqlite:///{tmp_path / 'shuffler.db'}",
            key_dir=tmp_path / "keys",
            channels=[POLICY],
            cors_origins=origins,
            **settings,
        )
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(_app(tmp_path, rate_burst=1, rate_per_second=0.01)) as started:
        yield started


def _contribution(client: TestClient | httpx.Client) -> bytes:
    config = client.get("/v1/config").json()
    key = load_x25519_public(base64.b64decode(config["public_key"]))
    epoch = int(time.time() // POLICY.epoch_seconds)
    contribution = Contribution(
        channel_id=POLICY.id, crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=()
    )
    return seal_contribution(contribution, config["id"], key)


def _granted(answer: httpx.Response) -> bool:
    found = {name: answer.headers.get(name) for name in GRANT}
    assert found in (GRANT, dict.fromkeys(GRANT)), found  # the whole grant or none of it
    return found == GRANT


def _cors_headers(answer: httpx.Response) -> list[str]:
    return [name for name in answer.headers if name.startswith("access-control-")]


def test_a_page_of_an_allowed_origin_enrols_sends_and_reads_retry_after(
    client: TestClient,
) -> None:
    origin = {"Origin": PAGE}
    descriptor = client.get("/v1/descriptor", headers=origin)
    assert descriptor.status_code == 200 and _granted(descriptor)
    enrolled = client.post("/v1/enroll", headers=origin)
    assert enrolled.status_code == 200 and _granted(enrolled)
    sent = {
        **origin,
        "Authorization": f"Bearer {enrolled.json()['client_token']}",
        "Content-Type": "application/octet-stream",
    }
    stored = client.post(ROUTE, content=_contribution(client), headers=sent)
    assert stored.status_code == 202 and _granted(stored)
    assert stored.headers["vary"] == "Origin"
    slowed = client.post(ROUTE, content=_contribution(client), headers=sent)
    assert slowed.status_code == 429 and _granted(slowed)  # a page can read Retry-After
    assert int(slowed.headers["retry-after"]) >= 1
    refused = client.post(ROUTE, content=b"x", headers={**origin, "Authorization": "Bearer x"})
    assert refused.status_code == 401 and _granted(refused)


@pytest.mark.parametrize(("path", "route"), list(DEVICE_ROUTES.items()))
def test_each_device_route_grants_its_preflight(client: TestClient, path: str, route: Any) -> None:
    asked = {
        "Origin": PAGE,
        "Access-Control-Request-Method": route.methods[0],
        "Access-Control-Request-Headers": ",".join(route.headers).lower(),
    }
    answer = client.options(path, headers=asked)
    assert answer.status_code == 204, answer.text
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert answer.headers["access-control-allow-methods"] == ", ".join(route.methods)
    assert answer.headers["access-control-max-age"] == str(MAX_AGE)
    assert answer.headers.get("access-control-allow-headers") == (", ".join(route.headers) or None)


def test_the_contribution_preflight_allows_what_a_device_sends() -> None:
    assert set(DEVICE_ROUTES) == {ROUTE, "/v1/enroll", "/v1/descriptor"}
    assert DEVICE_ROUTES[ROUTE].headers == ("Authorization", "Content-Type")


def test_another_origin_gets_no_grant_and_a_refused_preflight(client: TestClient) -> None:
    other = {"Origin": "http://127.0.0.1:8001"}
    for answer in (
        client.get("/v1/descriptor", headers=other),
        client.post("/v1/enroll", headers=other),
        client.post(ROUTE, content=b"x", headers={**other, "Authorization": "Bearer x"}),
    ):
        assert not _cors_headers(answer) and answer.headers["vary"] == "Origin"
    asked = {**other, "Access-Control-Request-Method": "POST"}
    refused = client.options(ROUTE, headers=asked)
    assert refused.status_code == 403 and refused.json()["error"] == "cors_origin_refused"
    assert not _cors_headers(refused)


@pytest.mark.parametrize(("method", "path"), OTHERS)
def test_no_other_route_ever_answers_a_page(client: TestClient, method: str, path: str) -> None:
    body = {} if method == "POST" else None
    answer = client.request(method, path, headers={"Origin": PAGE, **ADMIN}, json=body)
    assert answer.status_code < 300, answer.text
    assert not _cors_headers(answer) and "vary" not in answer.headers
    asked = {"Origin": PAGE, "Access-Control-Request-Method": method}
    refused = client.options(path, headers=asked)
    assert refused.status_code == 403 and refused.json()["error"] == "cors_route_refused"
    assert not _cors_headers(refused)


def test_refused_preflights_are_counted_per_device_route(client: TestClient) -> None:
    client.options(ROUTE, headers={"Origin": "https://evil.example"})
    client.options("/v1/admin/close", headers={"Access-Control-Request-Method": "POST"})
    metrics = client.get("/metrics", headers=ADMIN).text
    assert (
        'esa_shuffler_requests_rejected_total{reason="cors_origin_refused",'
        'route="OPTIONS /v1/contributions"} 1.0' in metrics
    )
    assert (
        'esa_shuffler_requests_rejected_total{reason="cors_route_refused",route="OPTIONS"} 1.0'
        in metrics
    )


def test_the_fast_path_grants_an_allowed_origin_over_real_http(tmp_path: Path) -> None:
    """The services' HTTP server answers ``POST /v1/contributions`` through the app's direct
    route, outside every middleware: the grant is the direct route's own."""
    app = _app(tmp_path)
    with served(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
        direct = app.direct_route("POST", ROUTE)
        assert direct is not None and not isinstance(direct, Ingest)  # the granting wrapper
        token = http.post("/v1/enroll").json()["client_token"]
        sent = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
        stored = http.post(ROUTE, content=_contribution(http), headers={**sent, "Origin": PAGE})
        assert stored.status_code == 202 and _granted(stored)
        refused = http.post(ROUTE, content=b"x", headers={"Origin": PAGE})
        assert refused.status_code == 401 and _granted(refused)
        stranger = http.post(ROUTE, content=b"x", headers={"Origin": "https://evil.example"})
        assert not _cors_headers(stranger) and stranger.headers["vary"] == "Origin"
        asked = {"Origin": PAGE, "Access-Control-Request-Method": "POST"}
        assert http.options(ROUTE, headers=asked).status_code == 204


def test_by_default_no_page_is_granted_and_the_fast_path_is_the_bare_ingest(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path, origins="")
    with TestClient(app) as client:
        assert isinstance(app.direct_route("POST", ROUTE), Ingest)
        answer = client.post(ROUTE, content=b"x", headers={"Origin": PAGE})
        assert answer.status_code == 401 and not _cors_headers(answer)
        assert "vary" not in answer.headers
        asked = {"Origin": PAGE, "Access-Control-Request-Method": "POST"}
        assert client.options(ROUTE, headers=asked).json()["error"] == "cors_origin_refused"


def _preflights(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        path: operations["options"]
        for path, operations in document["paths"].items()
        if "options" in operations
    }


def test_the_openapi_documents_each_device_routes_preflight(tmp_path: Path) -> None:
    with TestClient(_app(tmp_path / "granting")) as client:
        granting = _preflights(client.get("/openapi.json").json())
    with TestClient(_app(tmp_path / "default", origins="")) as client:
        default = _preflights(client.get("/openapi.json").json())
    assert set(granting) == set(default) == set(DEVICE_ROUTES)
    contributions = granting[ROUTE]
    origin, method, headers = contributions["parameters"]
    assert (origin["name"], origin["required"], origin["schema"]["enum"]) == (
        "Origin",
        True,
        [PAGE],
    )
    assert method["schema"]["enum"] == ["POST"] and not headers["required"]
    assert set(contributions["responses"]) == {"204", "403", "400", "408", "431", "500"}
    granted = contributions["responses"]["204"]["headers"]
    assert set(granted) == {
        "Access-Control-Allow-Origin",
        "Access-Control-Allow-Methods",
        "Access-Control-Allow-Headers",
        "Access-Control-Max-Age",
    }
    refusal = contributions["responses"]["403"]["content"]["application/json"]["schema"]
    assert refusal == {"$ref": "#/components/schemas/ErrorBody"}
    assert "204" not in default[ROUTE]["responses"]  # no origin allowed: never granted
    assert "enum" not in default[ROUTE]["parameters"][0]["schema"]
