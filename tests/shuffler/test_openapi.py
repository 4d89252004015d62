"""Issue 12, the shuffler's HTTP surface over real HTTP to a uvicorn process: the OpenAPI states
every status each route answers (and nothing it does not), a wrong method is a 405 with
``Allow``, admin tokens are checked before bodies, the request head is bounded, malformed framing
and non-UTF-8 JSON get the ``{"error", "detail"}`` shape, and refusals are counted per route
apart from refused contributions."""

from __future__ import annotations

import base64
import re
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from common.wire import ChannelPolicy
from runtime.server import HEAD_LIMIT, RAW_HEAD_LIMIT
from shuffler.app import create_app
from shuffler.settings import ShufflerSettings

from ..support import SMALL_CHANNEL, ServiceProcess, shuffler_process

ADMIN = {"Authorization": "Bearer development"}
ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    process = shuffler_process(tmp_path_factory.mktemp("openapi"), "shuffler-1", [SMALL_CHANNEL])
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def document(service: ServiceProcess) -> dict[str, Any]:
    return dict(httpx.get(service.url + "/openapi.json", timeout=10).json())


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    body = dict(response.json())
    assert set(body) == {"error", "detail"} and body["error"] == code and body["detail"], body
    return body


# --- the document ---------------------------------------------------------------------------


@pytest.mark.system
def test_contributions_are_documented_with_body_answer_and_every_refusal(
    document: dict[str, Any],
) -> None:
    operation = document["paths"]["/v1/contributions"]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    assert body["content"] == {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
    }
    accepted = operation["responses"]["202"]["content"]["application/json"]["schema"]
    assert accepted == {"$ref": "#/components/schemas/Receipt"}
    assert set(operation["responses"]) == {
        "202", "400", "401", "408", "409", "413", "429", "431", "500", "503"
    }  # fmt: skip
    retry_after = operation["responses"]["429"]["headers"]["Retry-After"]
    assert retry_after["required"] is True and retry_after["schema"]["type"] == "integer"
    assert operation["security"] == [{"ClientToken": []}]


@pytest.mark.system
def test_every_error_is_the_error_shape_and_no_status_is_invented(
    document: dict[str, Any],
) -> None:
    expected = {
        ("post", "/v1/contributions"): {"202", "400", "401", "409", "413", "429", "503"},
        ("post", "/v1/enroll"): {"200", "400", "429"},
        ("get", "/v1/config"): {"200", "400"},
        ("post", "/v1/admin/close"): {"200", "400", "401", "422", "503"},
        ("post", "/v1/admin/revoke"): {"200", "400", "401", "503"},
        ("post", "/v1/admin/requeue"): {"200", "400", "401", "503"},
        ("get", "/v1/admin/keys"): {"200", "400", "401", "404", "503"},
        ("post", "/v1/admin/keys/rotate"): {"200", "400", "401", "404", "409", "503"},
        ("post", "/v1/admin/keys/retire"): {"200", "400", "401", "404", "409", "503"},
        ("get", "/v1/descriptor"): {"200", "400"},
        # CORS preflights of the device routes (the launcher's local profile allows a page)
        ("options", "/v1/contributions"): {"204", "400", "403"},
        ("options", "/v1/enroll"): {"204", "400", "403"},
        ("options", "/v1/descriptor"): {"204", "400", "403"},
        ("get", "/healthz"): {"200", "400"},
        ("get", "/readyz"): {"200", "400", "503"},
        ("get", "/metrics"): {"200", "400", "401"},
    }
    found = {
        (method, path): operation["responses"]
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    assert set(found) == set(expected)
    for key, responses in found.items():
        assert set(responses) == expected[key] | {"408", "431", "500"}, key  # any request
        for status, answer in responses.items():
            if int(status) >= 400:
                assert answer["content"] == ERROR, (key, status)
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["CloseRequest"]["properties"]["channel_id"]["enum"] == ["homepage"]


@pytest.mark.system
def test_metrics_are_documented_as_text_behind_a_token(document: dict[str, Any]) -> None:
    operation = document["paths"]["/metrics"]["get"]
    assert operation["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }
    assert operation["security"] == [{"MetricsToken": []}]
    schemes = document["components"]["securitySchemes"]
    assert {name: scheme["scheme"] for name, scheme in schemes.items()} == {
        "ClientToken": "bearer",
        "AdminToken": "bearer",
        "MetricsToken": "bearer",
    }
    for path in ("/v1/admin/close", "/v1/admin/revoke", "/v1/admin/requeue"):
        assert document["paths"][path]["post"]["security"] == [{"AdminToken": []}]


@pytest.mark.system
def test_the_descriptor_and_requeue_are_documented_with_their_schemas(
    document: dict[str, Any],
) -> None:
    """``GET /v1/descriptor`` is public and answers a SignedDescriptor; ``POST
    /v1/admin/requeue`` takes an optional batch id (32 hex digits, nothing else) and answers a
    RequeueResult."""
    descriptor = document["paths"]["/v1/descriptor"]["get"]
    assert "security" not in descriptor
    answer = descriptor["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/SignedDescriptor"}
    schemas = document["components"]["schemas"]
    assert set(schemas["SignedDescriptor"]["required"]) == {"descriptor", "signature"}
    requeue = document["paths"]["/v1/admin/requeue"]["post"]
    body = requeue["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/RequeueRequest"}
    request = schemas["RequeueRequest"]
    assert request["additionalProperties"] is False and "required" not in request
    pattern = next(
        option["pattern"]
        for option in request["properties"]["batch_id"]["anyOf"]
        if option.get("type") == "string"
    )
    assert pattern == "^[0-9a-f]{32}$"
    result = requeue["responses"]["200"]["content"]["application/json"]["schema"]
    assert result == {"$ref": "#/components/schemas/RequeueResult"}
    assert schemas["RequeueResult"]["required"] == ["requeued"]


# --- answers --------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/contributions", "POST"),  # past the ingest fast path, to FastAPI
        ("GET", "/v1/contributions", "POST"),
        ("DELETE", "/v1/admin/close", "POST"),
        ("PATCH", "/v1/enroll", "POST"),
        ("POST", "/healthz", "GET"),
        ("POST", "/v1/descriptor", "GET"),
        ("GET", "/v1/admin/requeue", "POST"),
        ("PUT", "/metrics", "GET"),
    ],
)
def test_a_wrong_method_is_405_json_with_allow(
    service: ServiceProcess, method: str, path: str, allowed: str
) -> None:
    response = httpx.request(method, service.url + path, content=b"{}", headers=JSON)
    _error(response, 405, "method_not_allowed")
    assert allowed in [m.strip() for m in response.headers["allow"].split(",")]


BAD_BODIES = [
    b"{not json",
    b'{"channel_id": "\xff\xfe", "epoch": 1}',
    b'{"channel_id": "", "epoch": false}',
    b'{"client_id": 7}',
    b"[" * 10_000,
]


@pytest.mark.system
@pytest.mark.parametrize(
    "path",
    [
        "/v1/admin/close",
        "/v1/admin/revoke",
        "/v1/admin/requeue",
        "/v1/admin/keys/rotate",
        "/v1/admin/keys/retire",
    ],
)
def test_the_admin_token_is_checked_before_the_body(service: ServiceProcess, path: str) -> None:
    for body in BAD_BODIES:
        for credential in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": b"Bearer \xff"},
        ):
            sent = httpx.post(service.url + path, content=body, headers={**JSON, **credential})
            _error(sent, 401, "bad_admin_token")
        _error(httpx.post(service.url + path, content=body, headers={**JSON, **ADMIN}), 400,
               "invalid_request")  # fmt: skip


@pytest.mark.system
def test_a_json_body_that_is_not_utf8_gets_the_error_shape(service: ServiceProcess) -> None:
    body = b'{"channel_id": "homepage\xff", "epoch": 1}'
    sent = httpx.post(service.url + "/v1/admin/close", content=body, headers={**JSON, **ADMIN})
    assert "UTF-8" in _error(sent, 400, "invalid_request")["detail"]


@pytest.mark.system
@pytest.mark.parametrize("epoch", [False, True, "1", 1.5, -1, 2**53, 2**64])
def test_close_takes_a_json_integer_epoch_only(service: ServiceProcess, epoch: object) -> None:
    body = {"channel_id": "homepage", "epoch": epoch}
    sent = httpx.post(service.url + "/v1/admin/close", json=body, headers=ADMIN)
    _error(sent, 400, "invalid_request")


@pytest.mark.system
def test_close_of_a_channel_outside_the_documented_enum_is_400(service: ServiceProcess) -> None:
    for channel in ("", "nope", "x" * 10_000):
        body = {"channel_id": channel, "epoch": 0}
        sent = httpx.post(service.url + "/v1/admin/close", json=body, headers=ADMIN)
        _error(sent, 400, "unknown_channel")


# --- the server below the routes: head limit and framing -------------------------------------


def _address(service: ServiceProcess) -> tuple[str, int]:
    host, port = service.url.removeprefix("http://").split(":")
    return host, int(port)


def _read_all(conn: socket.socket) -> bytes:
    answer = b""
    conn.settimeout(10)
    while chunk := conn.recv(65536):
        answer += chunk
    return answer


def _raw(service: ServiceProcess, request: bytes) -> bytes:
    with socket.create_connection(_address(service), timeout=10) as conn:
        conn.sendall(request)
        return _read_all(conn)


def _answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _get_with_header(size: int) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"


@pytest.mark.system
def test_a_request_head_over_the_limit_is_431_json(service: ServiceProcess) -> None:
    status, _, _ = _answer(_raw(service, _get_with_header(HEAD_LIMIT - 1024)))
    assert status == 200
    status, headers, body = _answer(_raw(service, _get_with_header(HEAD_LIMIT + 1024)))
    assert status == 431 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert httpx.Response(431, content=body).json()["error"] == "head_too_large"


@pytest.mark.system
def test_an_endless_header_is_cut_off_before_it_ends(service: ServiceProcess) -> None:
    """A header that never ends is refused once :data:`RAW_HEAD_LIMIT` bytes have arrived."""
    with socket.create_connection(_address(service), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent = 0
        while sent < 4 * RAW_HEAD_LIMIT and not select.select([conn], [], [], 0.05)[0]:
            conn.sendall(b"a" * 4096)
            sent += 4096
        answer = _read_all(conn)
    status, _, body = _answer(answer)
    assert status == 431 and sent < 2 * RAW_HEAD_LIMIT, sent
    assert httpx.Response(431, content=body).json()["error"] == "head_too_large"


@pytest.mark.system
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /heal\xffthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHo st: x\r\n\r\n",
        b"NOT-HTTP\r\n\r\n",
    ],
)
def test_malformed_framing_is_400_json(service: ServiceProcess, request_bytes: bytes) -> None:
    status, headers, body = _answer(_raw(service, request_bytes))
    assert status == 400 and headers["content-type"] == "application/json", (headers, body)
    assert httpx.Response(400, content=body).json()["error"] == "malformed_http"


@pytest.mark.system
def test_an_upgrade_request_is_an_ordinary_request(service: ServiceProcess) -> None:
    """No WebSocket is served: an upgrade gets the route's JSON answer, not uvicorn's 403."""
    request = (
        b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Connection: close\r\n\r\n"
    )
    status, headers, body = _answer(_raw(service, request))
    assert status == 404 and headers["content-type"] == "application/json", (headers, body)


# --- metrics --------------------------------------------------------------------------------


def _counter(text: str, name: str, **labels: str) -> float:
    pattern = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    found = re.search(rf"^{name}\{{{pattern}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.system
def test_refusals_are_counted_per_route_apart_from_contributions(service: ServiceProcess) -> None:
    def scrape() -> str:
        return httpx.get(service.url + "/metrics", headers=ADMIN, timeout=10).text

    before = scrape()
    httpx.post(service.url + "/v1/admin/close", json={"channel_id": "homepage", "epoch": 0})
    httpx.post(service.url + "/v1/admin/revoke", content=b"{", headers={**JSON, **ADMIN})
    httpx.get(service.url + "/metrics")
    bad_token = {"Authorization": "Bearer nope.nope", "Content-Type": "application/octet-stream"}
    httpx.post(service.url + "/v1/contributions", content=b"x" * 64, headers=bad_token)
    after = scrape()

    requests, contributions = (
        "esa_shuffler_requests_rejected_total",
        "esa_shuffler_contributions_rejected_total",
    )
    for route, reason in (
        ("/v1/admin/close", "bad_admin_token"),
        ("/v1/admin/revoke", "invalid_request"),
        ("/metrics", "bad_metrics_token"),
    ):
        change = _counter(after, requests, route=route, reason=reason) - _counter(
            before, requests, route=route, reason=reason
        )
        assert change == 1, (route, reason)
    assert (
        _counter(after, contributions, reason="bad_token")
        - _counter(before, contributions, reason="bad_token")
        == 1
    )
    reasons = set(re.findall(rf'^{contributions}\{{reason="([^"]+)"\}}', after, re.MULTILINE))
    assert not reasons & {"bad_admin_token", "invalid_request", "bad_metrics_token"}, reasons


# --- in process: the documented route is the same ingest ------------------------------------


def _app(tmp_path: Path) -> Any:
    settings = ShufflerSettings(
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
        key_dir=tmp_path / "keys",
        channels=[ChannelPolicy(**SMALL_CHANNEL)],
    )
    return create_app(settings)


def test_the_fastapi_route_answers_like_the_fast_path(tmp_path: Path) -> None:
    with TestClient(_app(tmp_path)) as client:
        refused = client.post("/v1/contributions", content=b"x", headers={"Authorization": "x"})
        assert refused.status_code == 401 and refused.json()["error"] == "bad_token"
        token = client.post("/v1/enroll").json()["client_token"]
        key = load_x25519_public(base64.b64decode(client.get("/v1/config").json()["public_key"]))
        epoch = int(time.time() // SMALL_CHANNEL["epoch_seconds"])
        blob = seal_contribution(
            Contribution(
                channel_id="homepage", crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=()
            ),
            "shuffler-1",
            key,
        )
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
        stored = client.post("/v1/contributions", content=blob, headers=headers)
        assert stored.status_code == 202 and len(stored.json()["receipt"]) == 32


def test_an_unexpected_ingest_failure_is_a_json_500(tmp_path: Path) -> None:
    """Without its lifespan the app's commit queue is not running: storing fails with a bug,
    not a refusal, and the answer is still the error shape (logged, nothing internal)."""
    client = TestClient(_app(tmp_path), raise_server_exceptions=False)
    token = client.post("/v1/enroll").json()["client_token"]
    key = load_x25519_public(base64.b64decode(client.get("/v1/config").json()["public_key"]))
    epoch = int(time.time() // SMALL_CHANNEL["epoch_seconds"])
    blob = seal_contribution(
        Contribution(
            channel_id="homepage", crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=()
        ),
        "shuffler-1",
        key,
    )
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
    failed = client.post("/v1/contributions", content=blob, headers=headers)
    assert failed.status_code == 500
    assert failed.json() == {
        "error": "internal",
        "detail": "unexpected server error; it has been logged",
    }
