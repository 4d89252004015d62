"""The HTTP edge against a real app over SQLite: typed answers in the shapes clients read, and
every non-2xx answer as JSON ``{"error", "detail"}`` with a human sentence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from analyzer.app import create_app
from analyzer.settings import AnalyzerSettings
from common.collection import verify_config
from common.envelope import load_ed25519_public, public_identity
from common.wire import Ledger, Lifetime, PrivacyOverview, ReleaseBody, ShufflerInfo, unb64

from .helpers import ANALYZER_KEY, CHANNEL, SHUFFLERS, VALUES, make_batch

ADMIN = {"Authorization": "Bearer development"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """The analyzer app over a SQLite file, trusting :data:`SHUFFLERS`; it opens fragments
    sealed to :data:`ANALYZER_KEY` (written as its current HPKE key)."""
    from cryptography.hazmat.primitives import serialization

    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "hpke.pem").write_bytes(
        ANALYZER_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    shufflers = [
        ShufflerInfo(
            id=name,
            url="http://127.0.0.1:1",
            **public_identity(ANALYZER_KEY.public_key(), key.public_key()),
        )
        for name, key in SHUFFLERS.items()
    ]
    settings = AnalyzerSettings(
        database_url=f"sqlite:///{tmp_path / 'analyzer.db'}",
        key_dir=keys,
        channels=[CHANNEL],
        channels_file=None,
        shufflers=shufflers,
        shufflers_file=None,
        max_batch_bytes=4 * 1024 * 1024,
        opening_processes=1,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def _refusal(response: Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == code
    detail: str = body["detail"]
    assert detail and not any(mark in detail for mark in ("{", "'loc'", "Error("))
    return detail


def _post(client: TestClient, body: bytes, signature: str | None) -> Response:
    headers = {} if signature is None else {"ESA-Signature": signature}
    response: Response = client.post("/v1/batches", content=body, headers=headers)
    return response


def _opened(client: TestClient) -> None:
    """Open every stored part now (the background opener may get there first: folding is
    idempotent)."""
    client.app.state.service.opener.open_pending()  # type: ignore[attr-defined]


def test_unknown_route_wrong_method_and_bad_parameter_answer_the_error_shape(
    client: TestClient,
) -> None:
    assert _refusal(client.get("/v1/nowhere"), 404, "not_found") == "no such route"
    _refusal(client.get("/v1/batches"), 405, "method_not_allowed")
    _refusal(client.delete("/v1/config"), 405, "method_not_allowed")
    detail = _refusal(
        client.get("/v1/channels/homepage/estimate?epoch=abc"), 400, "invalid_request"
    )
    assert "query.epoch" in detail and "integer" in detail
    for huge in ("epoch=99999999999999999999999", "epoch_from=9223372036854775808", "top=-1"):
        _refusal(client.get(f"/v1/channels/homepage/estimate?{huge}"), 400, "invalid_request")


def test_domain_refusals_keep_their_codes_and_statuses(client: TestClient) -> None:
    estimate = client.get("/v1/channels/elsewhere/estimate?epoch=1")
    assert "not configured" in _refusal(estimate, 404, "unknown_channel")
    _refusal(client.get("/v1/channels/elsewhere/privacy"), 404, "unknown_channel")
    assert "yet" in _refusal(client.get("/v1/channels/homepage/estimate"), 404, "no_data")
    _refusal(client.get("/v1/channels/homepage/estimate?epoch=3"), 404, "no_data")
    body, signature = make_batch(VALUES[:100])
    assert "header" in _refusal(_post(client, body, None), 401, "bad_signature")
    _refusal(_post(client, body, signature[::-1]), 401, "bad_signature")
    _refusal(_post(client, b"x" * (4 * 1024 * 1024 + 1), "c2ln"), 413, "too_large")
    _refusal(_post(client, *make_batch(VALUES[:10])), 422, "below_min_crowd")
    assert "batch_id" in _refusal(_post(client, b"{}", "c2ln"), 400, "malformed")
    metrics = client.get("/metrics").text
    assert 'esa_analyzer_batches_rejected_total{reason="bad_signature"} 2.0' in metrics


def test_batches_releases_ledger_and_config_keep_their_wire_shapes(client: TestClient) -> None:
    body, signature = make_batch(VALUES)
    first = _post(client, body, signature)
    assert first.status_code == 201
    assert first.json() == {"batch_id": first.json()["batch_id"], "part": 0, "duplicate": False}
    again = _post(client, body, signature)
    assert again.status_code == 200
    assert again.json() == {**first.json(), "duplicate": True}
    _opened(client)
    listed = client.get("/v1/channels").json()["channels"]
    assert listed == [{**CHANNEL.model_dump(mode="json"), "epochs": [7, 7]}]
    release = client.get("/v1/channels/homepage/estimate").json()
    assert set(release) == set(ReleaseBody.model_fields)
    assert release["epochs"] == [7, 7] and release["n"] == VALUES.size
    assert len(release["ci95"][0]) == 2 and release["certificate"]["eps"] > 0
    assert client.get("/v1/channels/homepage/estimate?epoch=7&top=3").json()["bins"][:1] == [0]
    ledger = client.get("/v1/channels/homepage/privacy").json()
    assert set(ledger) == set(Ledger.model_fields) and ledger["releases"] == []
    assert [row["epoch"] for row in ledger["epochs"]] == [7]
    assert ledger["epochs"][0]["certificate"]["eps"] == release["certificate"]["eps"]
    assert set(ledger["lifetime"]) == set(Lifetime.model_fields)
    published = client.post("/v1/channels/homepage/releases", json={"epoch": 7}, headers=ADMIN)
    assert published.status_code == 201 and set(published.json()) == set(ReleaseBody.model_fields)
    ledger = client.get("/v1/channels/homepage/privacy").json()
    assert [r["epochs"] for r in ledger["releases"]] == [[7, 7]]
    assert ledger["releases"][0]["certificate"] == release["certificate"]
    overview = client.get("/v1/privacy").json()
    assert set(overview) == set(PrivacyOverview.model_fields) and overview["epochs"] == 1
    document = client.get("/v1/config").json()
    signer = load_ed25519_public(unb64(document["config"]["analyzer"]["signing_key"]))
    config = verify_config(document, signer, document["config"]["issued_at"])
    assert config.channel("homepage") == CHANNEL
    page = client.get("/")
    assert page.status_code == 200 and 'id="homepage"' in page.text


def test_every_route_documents_the_error_shape(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    batches = paths["/v1/batches"]["post"]["responses"]
    assert {"200", "201", "400", "401", "413", "422", "500"} <= set(batches)
    error = batches["422"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/ErrorBody")
    for path in ("/v1/channels/{channel_id}/estimate", "/v1/channels/{channel_id}/privacy"):
        assert "404" in paths[path]["get"]["responses"]
    assert {"201", "401", "404"} <= set(
        paths["/v1/channels/{channel_id}/releases"]["post"]["responses"]
    )


def test_estimates_are_reads_300_gets_change_nothing(client: TestClient) -> None:
    assert _post(client, *make_batch(VALUES)).status_code == 201
    _opened(client)
    store = client.app.state.service.store  # type: ignore[attr-defined]
    before, ledger = store.counts(), client.get("/v1/channels/homepage/privacy").json()
    answers = {client.get("/v1/channels/homepage/estimate").text for _ in range(300)}
    assert len(answers) == 1
    assert store.counts() == before and before["releases"] == 0
    assert client.get("/v1/channels/homepage/privacy").json() == ledger


def test_publishing_needs_the_admin_token_and_is_recorded(client: TestClient) -> None:
    assert _post(client, *make_batch(VALUES)).status_code == 201
    _opened(client)
    url = "/v1/channels/homepage/releases"
    _refusal(client.post(url, json={"epoch": 7}), 401, "bad_admin_token")
    _refusal(
        client.post(url, json={"epoch": 7}, headers={"Authorization": "Bearer x"}),
        401,
        "bad_admin_token",
    )
    assert client.get("/v1/channels/homepage/privacy").json()["releases"] == []
    _refusal(client.post("/v1/channels/elsewhere/releases", headers=ADMIN), 404, "unknown_channel")
    _refusal(client.post(url, json={"epoch": 9}, headers=ADMIN), 404, "no_data")
    _refusal(client.post(url, json={"epoch": "x"}, headers=ADMIN), 400, "invalid_request")
    published = client.post(url, headers=ADMIN)
    assert published.status_code == 201 and published.json()["epochs"] == [7, 7]
    recorded = client.get("/v1/channels/homepage/privacy").json()["releases"]
    assert len(recorded) == 1 and recorded[0]["n"] == VALUES.size
    assert recorded[0]["certificate"] == published.json()["certificate"]
