"""Every status code of the shuffler's routes (docs/protocol.md), over real HTTP to uvicorn."""

from __future__ import annotations

import base64
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import (
    MAGIC,
    OLD_MAGIC,
    Contribution,
    load_x25519_public,
    new_nonce,
    outer_info,
    seal,
    seal_contribution,
)

from ..support import SMALL_CHANNEL, ServiceProcess, shuffler_process

pytestmark = pytest.mark.system  # starts real processes

CHANNEL = {**SMALL_CHANNEL, "crowds": ["", "eu", "us"], "min_fragments": 1}
ANALYZER = X25519PrivateKey.generate()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("http")
    process = shuffler_process(
        tmp, "shuffler-1", [CHANNEL], rate_per_second="0.5", rate_burst="3", max_body_bytes="4096"
    ).start()
    yield process
    process.stop()


def _public(service: ServiceProcess) -> object:
    config = httpx.get(service.url + "/v1/config").json()
    return load_x25519_public(base64.b64decode(config["public_key"]))


def _token(service: ServiceProcess) -> str:
    response = httpx.post(service.url + "/v1/enroll")
    assert response.status_code == 200
    return str(response.json()["client_token"])


def _blob(
    service: ServiceProcess,
    channel: str = "homepage",
    fragments: int = 2,
    nonce: bytes | None = None,
    shuffler: str = "shuffler-1",
    crowd: str = "",
) -> bytes:
    contribution = Contribution(
        channel_id=channel,
        crowd_id=crowd,
        epoch=int(time.time() // 3600),
        nonce=nonce or new_nonce(),
        fragments=tuple(bytes(72) for _ in range(fragments)),
    )
    return seal_contribution(contribution, shuffler, _public(service))  # type: ignore[arg-type]


def _post(
    service: ServiceProcess,
    body: bytes,
    token: str | None,
    content_type: str = "application/octet-stream",
) -> httpx.Response:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(service.url + "/v1/contributions", content=body, headers=headers, timeout=30)


def _error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"] == code and response.json()["detail"]


def test_202_after_commit_with_receipt(service: ServiceProcess) -> None:
    response = _post(service, _blob(service), _token(service))
    assert response.status_code == 202 and len(response.json()["receipt"]) == 32


def test_400_malformed_wrong_channel_wrong_shuffler_and_content_type(
    service: ServiceProcess,
) -> None:
    token = _token(service)
    _error(_post(service, b"not a ciphertext at all" * 4, token), 400, "malformed")
    _error(_post(service, _blob(service, channel="other"), _token(service)), 400, "unknown_channel")
    _error(_post(service, _blob(service, shuffler="shuffler-2"), _token(service)), 400, "malformed")
    _error(
        _post(service, _blob(service), _token(service), "application/json"), 400, "bad_content_type"
    )


def test_400_unsupported_version_for_a_wire_version_1_contribution(
    service: ServiceProcess,
) -> None:
    """A contribution of wire version 1 (magic ``ESA1``: fragments bound to their channel only)
    is refused by name, genuinely sealed to this shuffler and otherwise acceptable; the same
    contribution as version 2 is taken, and the refusal used up neither quota nor nonce."""
    token, nonce = _token(service), new_nonce()
    contribution = Contribution(
        channel_id="homepage",
        crowd_id="",
        epoch=int(time.time() // 3600),
        nonce=nonce,
        fragments=tuple(bytes(72) for _ in range(2)),
    )
    encoded = contribution.encode()
    assert encoded.startswith(MAGIC)
    old = seal(OLD_MAGIC + encoded[4:], _public(service), outer_info("shuffler-1"))  # type: ignore[arg-type]
    refused = _post(service, old, token)
    _error(refused, 400, "unsupported_version")
    assert "version 1" in refused.json()["detail"]
    assert _post(service, _blob(service, nonce=nonce), token).status_code == 202


def test_400_too_few_fragments(service: ServiceProcess) -> None:
    """The channel's ``min_fragments`` (1): an empty contribution is no device's report."""
    _error(_post(service, _blob(service, fragments=0), _token(service)), 400, "too_few_fragments")
    assert _post(service, _blob(service, fragments=1), _token(service)).status_code == 202


def test_401_missing_forged_and_revoked_tokens(service: ServiceProcess) -> None:
    _error(_post(service, _blob(service), None), 401, "bad_token")
    token = _token(service)
    _error(_post(service, _blob(service), token[:-2] + "xx"), 401, "bad_token")
    for raw in (b"Bearer a.\xff", b"Bearer \xff\xfe.\xff"):  # non-ASCII: wrong, never a 500
        headers = {"Content-Type": "application/octet-stream", "Authorization": raw}
        sent = httpx.post(service.url + "/v1/contributions", content=b"x", headers=headers)
        _error(sent, 401, "bad_token")
    client_id = token.split(".")[0]
    revoke = httpx.post(
        service.url + "/v1/admin/revoke",
        json={"client_id": client_id},
        headers={"Authorization": "Bearer development"},
    )
    assert revoke.status_code == 200
    _error(_post(service, _blob(service), token), 401, "revoked")
    _error(
        httpx.post(service.url + "/v1/admin/revoke", json={"client_id": "x"}),
        401,
        "bad_admin_token",
    )


def test_409_replay_and_quota(service: ServiceProcess) -> None:
    token = _token(service)
    nonce = new_nonce()
    assert _post(service, _blob(service, nonce=nonce), token).status_code == 202
    _error(_post(service, _blob(service), token), 409, "quota_exceeded")
    _error(_post(service, _blob(service, nonce=nonce), _token(service)), 409, "replayed_nonce")


def test_crowds_are_declared_and_the_quota_covers_them_all(service: ServiceProcess) -> None:
    """Issue 12: an undeclared crowd is a 400; one token's second contribution to the same
    channel and epoch is a 409 whichever crowd it names (it used to get a 202 per crowd)."""
    _error(_post(service, _blob(service, crowd="asia"), _token(service)), 400, "unknown_crowd")
    token = _token(service)
    assert _post(service, _blob(service, crowd="eu"), token).status_code == 202
    for crowd in ("us", ""):
        _error(_post(service, _blob(service, crowd=crowd), token), 409, "quota_exceeded")
    assert (
        httpx.get(service.url + "/v1/config").json()["channels"][0]["crowds"] == CHANNEL["crowds"]
    )


def test_413_too_large_and_too_many_fragments(service: ServiceProcess) -> None:
    _error(_post(service, b"x" * 5000, _token(service)), 413, "too_large")
    _error(_post(service, _blob(service, fragments=5), _token(service)), 413, "too_many_fragments")


def test_429_with_retry_after(service: ServiceProcess) -> None:
    token = _token(service)
    statuses = [_post(service, b"x" * 100, token) for _ in range(6)]
    limited = [r for r in statuses if r.status_code == 429]
    assert limited and int(limited[0].headers["Retry-After"]) >= 1
    _error(limited[0], 429, "rate_limited")


def test_health_readiness_config_and_metrics(service: ServiceProcess) -> None:
    assert httpx.get(service.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(service.url + "/readyz").status_code == 200
    config = httpx.get(service.url + "/v1/config").json()
    assert config["id"] == "shuffler-1" and len(base64.b64decode(config["signing_key"])) == 32
    refused = httpx.get(service.url + "/metrics")
    _error(refused, 401, "bad_metrics_token")
    wrong = httpx.get(service.url + "/metrics", headers={"Authorization": b"Bearer \xff"})
    _error(wrong, 401, "bad_metrics_token")
    close = httpx.post(
        service.url + "/v1/admin/close",
        json={"channel_id": CHANNEL["id"], "epoch": 1},
        headers={"Authorization": b"Bearer \xff"},
    )
    _error(close, 401, "bad_admin_token")  # a non-ASCII token is wrong, never a 500
    admin = {"Authorization": "Bearer development"}
    for body, status, code in (
        ({"channel_id": CHANNEL["id"], "epoch": 2**40}, 422, "epoch_not_started"),
        ({"channel_id": "nope", "epoch": 1}, 400, "unknown_channel"),
    ):
        refused = httpx.post(service.url + "/v1/admin/close", json=body, headers=admin)
        _error(refused, status, code)  # and nothing is closed: later epochs stay open
    for scheme in ("bearer", "BEARER ", "Bearer"):  # RFC 9110 §11.1: any case, 1*SP
        authorization = {"Authorization": f"{scheme} development"}
        assert httpx.get(service.url + "/metrics", headers=authorization).status_code == 200
        future = {"channel_id": CHANNEL["id"], "epoch": 2**40}  # past the check: nothing closed
        close = httpx.post(service.url + "/v1/admin/close", json=future, headers=authorization)
        _error(close, 422, "epoch_not_started")
    for malformed in ("Basic development", "Bearerdevelopment", "Bearer  developmen"):
        _error(
            httpx.get(service.url + "/metrics", headers={"Authorization": malformed}),
            401,
            "bad_metrics_token",
        )
    metrics = httpx.get(service.url + "/metrics", headers={"Authorization": "Bearer development"})
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "esa_shuffler_contributions_received_total",
        "esa_shuffler_contributions_rejected_total",
        "esa_shuffler_contributions_deleted_total",
        "esa_shuffler_queue_depth",
        "esa_shuffler_batches_forwarded_total",
    ):
        assert name in metrics.text


def test_framework_errors_have_the_same_shape(service: ServiceProcess) -> None:
    _error(httpx.get(service.url + "/v1/nowhere"), 404, "not_found")
    _error(httpx.get(service.url + "/v1/enroll"), 405, "method_not_allowed")
    admin = {"Authorization": "Bearer development"}
    invalid = httpx.post(service.url + "/v1/admin/close", json={"epoch": -1}, headers=admin)
    _error(invalid, 400, "invalid_request")
    assert "channel_id" in invalid.json()["detail"] and "{" not in invalid.json()["detail"]


def test_admin_close_answers_a_close_result(service: ServiceProcess) -> None:
    close = httpx.post(
        service.url + "/v1/admin/close",
        json={"channel_id": "homepage", "epoch": 0},
        headers={"Authorization": "Bearer development"},
        timeout=30,
    )
    assert close.status_code == 200
    assert set(close.json()) == {"groups_evaluated", "forwarded", "retried", "failed"}


def test_503_when_storage_is_unavailable(tmp_path: Path) -> None:
    """Hold SQLite's write lock from outside: the commit fails, nothing is acknowledged, and
    the answer says when to ask again (``Retry-After``)."""
    process = shuffler_process(
        tmp_path, "shuffler-1", [CHANNEL], sqlite_busy_timeout_seconds="1"
    ).start()
    try:
        token = _token(process)
        blob = _blob(process)
        lock = sqlite3.connect(tmp_path / "shuffler-1" / "db.sqlite", timeout=1)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            response = _post(process, blob, token)
        finally:
            lock.rollback()
            lock.close()
        _error(response, 503, "storage_unavailable")
        # when to ask again (issue 49: a device waits a database restart out within its epoch)
        assert response.headers["Retry-After"] == "1"
        assert _post(process, blob, token).status_code == 202  # nothing was stored before
    finally:
        process.stop()


def test_logs_never_contain_tokens_or_client_ids(service: ServiceProcess) -> None:
    token = _token(service)
    _post(service, _blob(service), token)
    log_text = service.log_path.read_text()
    assert token not in log_text and token.split(".")[0] not in log_text


def test_the_enrolment_limit_is_per_address_behind_a_local_proxy(tmp_path: Path) -> None:
    """Behind HAProxy (``option forwardfor``, on this host) every device arrives from the
    proxy's address: uvicorn's proxy-headers middleware takes the device's own from
    ``X-Forwarded-For`` from the proxy it trusts (``trusted_proxies``, as ``esa up
    --replicas`` sets it), so one address spending its enrolments leaves the others theirs."""
    process = shuffler_process(
        tmp_path, "shuffler-1", [CHANNEL], enroll_per_minute="6", trusted_proxies="127.0.0.1"
    ).start()
    try:
        url = process.url + "/v1/enroll"
        first = [httpx.post(url, headers={"X-Forwarded-For": "203.0.113.7"}) for _ in range(2)]
        other = httpx.post(url, headers={"X-Forwarded-For": "203.0.113.8"})
    finally:
        process.stop()
    assert [a.status_code for a in first] == [200, 429]  # a burst of 6/6 = 1
    assert other.status_code == 200


def test_a_body_cut_short_by_a_closed_connection_is_not_stored(service: ServiceProcess) -> None:
    """A client that declares more bytes than it sends and goes away sent no contribution,
    even when the bytes that arrived are a whole sealed one: nothing is stored, so the same
    contribution sent properly afterwards is a first one (202), not a replay (an outside
    attack found it stored: a disconnect read as the end of the body)."""
    token, blob = _token(service), _blob(service)
    head = "\r\n".join(
        [
            "POST /v1/contributions HTTP/1.1",
            "Host: 127.0.0.1",
            f"Authorization: Bearer {token}",
            "Content-Type: application/octet-stream",
            f"Content-Length: {len(blob) + 10}",
        ]
    )
    address = service.url.removeprefix("http://").split(":")
    with socket.create_connection((address[0], int(address[1])), timeout=5) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + blob)
        time.sleep(0.3)  # the server holds the whole blob and waits for 10 more bytes
    time.sleep(0.3)  # it has seen the close
    response = _post(service, blob, token)
    assert response.status_code == 202, response.text
