"""The HTTP edge against a real app over SQLite: typed answers in the shapes clients read, and
every non-2xx answer as JSON ``{"error", "detail"}`` with a human sentence."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.testclient import TestClient
from httpx import Response

from common.collection import TrustAnchors, verify_collection
from common.envelope import load_ed25519_public, public_bytes, sign
from common.preauth import PREAUTH_HEADER, Preauth, preauth_header
from common.wire import (
    Batch,
    Ledger,
    Lifetime,
    PrivacyOverview,
    ReleaseBody,
    b64,
    unb64,
)

from .helpers import (
    CAP,
    CHANNEL,
    DESCRIPTORS,
    SHUFFLERS,
    VALUES,
    Signed,
    crowd,
    estimated,
    make_batch,
    signed,
)

ADMIN = {"Authorization": "Bearer development"}
#: A well-formed ``ESA-Signature`` that verifies for nothing.
ANY_SIGNATURE = base64.b64encode(bytes(64)).decode()


def _refusal(response: Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == code
    detail: str = body["detail"]
    assert detail and not any(mark in detail for mark in ("{'", '{"', "'loc'", "Error("))
    return detail


def _post(
    client: TestClient, body: bytes, signature: str | None, shuffler: str | None = "shuffler-1"
) -> Response:
    """POST a part as ``shuffler`` (the ``ESA-Shuffler`` header; None: no header)."""
    headers = {} if signature is None else {"ESA-Signature": signature}
    if shuffler is not None:
        headers["ESA-Shuffler"] = shuffler
    if shuffler in SHUFFLERS:  # the shuffler's own head: the body is what the test is about
        headers[PREAUTH_HEADER] = preauth_header(shuffler, body, SHUFFLERS[shuffler], time.time())
    response: Response = client.post("/v1/batches", content=body, headers=headers)
    return response


def _signed_body(body: bytes, shuffler: str = "shuffler-1") -> Signed:
    """Any bytes, validly signed by a registered shuffler."""
    return Signed(body, b64(sign(body, SHUFFLERS[shuffler])), shuffler)


def _opened(client: TestClient) -> None:
    """Open every stored part now and close the epochs whose close timeout passed (the
    background opener and closer may get there first: both are idempotent)."""
    service = client.app.state.service  # type: ignore[attr-defined]
    service.opener.open_pending()
    service.closer.close_due()


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
    body, signature, _ = make_batch(VALUES[:100])
    assert "header" in _refusal(_post(client, body, None), 401, "bad_signature")
    _refusal(_post(client, body, signature[::-1]), 401, "bad_signature")
    # the sender is named by ESA-Shuffler, and must be registered
    detail = _refusal(_post(client, body, signature, None), 401, "unknown_shuffler")
    assert "ESA-Shuffler header required" in detail
    assert "shuffler-9" in _refusal(
        _post(client, body, signature, "shuffler-9"), 401, "unknown_shuffler"
    )
    _refusal(_post(client, body, signature, "shuffler-2"), 401, "bad_signature")
    _refusal(_post(client, b"x" * (CAP + 1), ANY_SIGNATURE), 413, "too_large")
    _refusal(_post(client, *make_batch(VALUES[:10])), 422, "below_min_crowd")
    # an unverified body is not even parsed; a verified one that is not a batch is malformed
    _refusal(_post(client, b"{}", ANY_SIGNATURE), 401, "bad_signature")
    assert "shuffler_id" in _refusal(_post(client, *_signed_body(b"{}")), 400, "malformed")
    assert "64-byte" in _refusal(_post(client, b"{}", "c2ln"), 401, "bad_signature")
    # one batch per group; fragments the claimed contributions cannot carry
    assert _post(client, *make_batch(VALUES)).status_code == 201
    second = _refusal(_post(client, *make_batch(VALUES, seed=1)), 422, "duplicate_group")
    assert "a group is evaluated once" in second
    boasting = Batch.model_validate_json(make_batch(VALUES, epoch=8).body)
    boasting = boasting.model_copy(update={"n_contributions": 50})  # ~1,330 fragments > 50 x 20
    _refusal(_post(client, *signed(boasting)), 422, "inconsistent_counts")
    metrics = client.get("/metrics").text
    assert 'esa_analyzer_batches_rejected_total{reason="bad_signature"} 5.0' in metrics
    assert 'esa_analyzer_batches_rejected_total{reason="unknown_shuffler"} 2.0' in metrics
    assert 'esa_analyzer_batches_rejected_total{reason="duplicate_group"} 1.0' in metrics


def test_batches_releases_ledger_and_config_keep_their_wire_shapes(client: TestClient) -> None:
    body, signature, _ = make_batch(VALUES)
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
    assert release["epochs"] == [7, 7] and release["n"] == estimated(VALUES)
    assert release["crowd_check"] == {
        "batches": 1,
        "claimed": VALUES.size,
        "verified": crowd(VALUES),  # the lower bound its fragments prove
        "invalid_fragments": 0,
        "short_batches": 1,
        "withheld_batches": 0,
    }
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
    trust = TrustAnchors(signer, {k: v.public_key() for k, v in SHUFFLERS.items()})
    config = verify_collection(document, trust, document["config"]["issued_at"])
    assert config.channel("homepage") == CHANNEL
    # the shufflers' descriptors as they signed them, in registry order; nothing added
    assert document["config"]["shufflers"] == [
        DESCRIPTORS[name].model_dump(mode="json") for name in SHUFFLERS
    ]
    assert [s.signing_key for s in config.shufflers] == [
        b64(public_bytes(key.public_key())) for key in SHUFFLERS.values()
    ]
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
    assert len(recorded) == 1 and recorded[0]["n"] == estimated(VALUES)
    assert recorded[0]["certificate"] == published.json()["certificate"]


@dataclass
class Exchange:
    """One request driven through the ASGI app by hand: how much of its body the app asked
    for, and what it answered."""

    chunks_read: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}


def _drive(
    client: TestClient, headers: dict[str, str], chunks: Iterator[bytes], path: str = "/v1/batches"
) -> Exchange:
    """POST ``chunks`` as a streamed body straight into the app, counting the chunks it reads
    (TestClient reads a whole body before the app sees it, a real server does not)."""
    exchange = Exchange()

    async def receive() -> dict[str, Any]:
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        exchange.chunks_read += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        exchange.messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    asyncio.run(client.app(scope, receive, send))  # type: ignore[arg-type]
    return exchange


def _endless(chunk: int = 64 * 1024) -> Iterator[bytes]:
    while True:
        yield b" " * chunk


def _head(
    length: int, shuffler: str = "shuffler-1", signer: str = "shuffler-1", at: float = 0
) -> str:
    """An ``ESA-Preauth`` value for a body of ``length`` bytes (of any digest) claiming
    ``shuffler``, signed by ``signer``'s key, ``at`` seconds from now."""
    unsigned = Preauth(int(time.time() + at), length, "0" * 64, b"")
    signature = b64(sign(unsigned.message(shuffler), SHUFFLERS[signer]))
    return f"{unsigned.timestamp}.{length}.{unsigned.digest}.{signature}"


def test_a_batch_is_refused_before_its_body_is_read(client: TestClient) -> None:
    """Issue 12: an unsigned 100 MB body used to be read whole before any check. A declared
    length over the cap, a non-JSON type, a missing or ill-formed signature are refused before
    a byte of the body is read; a streamed body is cut off right after the cap."""
    sender = {"ESA-Shuffler": "shuffler-1"}
    well_formed = {**sender, "ESA-Signature": ANY_SIGNATURE, PREAUTH_HEADER: _head(CAP)}
    unheaded = {**sender, "ESA-Signature": ANY_SIGNATURE}
    refusals = [
        (unheaded, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: "1.2.3"}, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: _head(CAP, signer="shuffler-2")}, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: _head(CAP, "shuffler-2")}, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: _head(CAP, at=-3600)}, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: _head(CAP, at=3600)}, 401, "bad_preauth"),
        ({**unheaded, PREAUTH_HEADER: _head(CAP + 1)}, 413, "too_large"),
        ({**well_formed, "Content-Length": str(100 * 1024 * 1024)}, 413, "too_large"),
        ({**sender, "Content-Length": str(CAP + 1)}, 401, "bad_signature"),
        ({**well_formed, "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ({}, 401, "unknown_shuffler"),
        ({"ESA-Signature": ANY_SIGNATURE}, 401, "unknown_shuffler"),
        ({"ESA-Signature": ANY_SIGNATURE, "ESA-Shuffler": "shuffler-9"}, 401, "unknown_shuffler"),
        ({**sender, "ESA-Signature": "c2ln"}, 401, "bad_signature"),
        ({**sender, "ESA-Signature": "not base64!"}, 401, "bad_signature"),
        (
            {**sender, "Content-Length": "12", "ESA-Signature": ANY_SIGNATURE + "="},
            401,
            "bad_signature",
        ),
        ({**well_formed, "Content-Length": "-1"}, 400, "malformed"),
        ({**well_formed, "Content-Length": "\u00b2"}, 400, "malformed"),
    ]
    for headers, status, code in refusals:
        exchange = _drive(client, headers, _endless())
        assert (exchange.status, exchange.chunks_read) == (status, 0), headers
        assert json.loads(exchange.messages[1]["body"])["error"] == code, headers
    streamed = _drive(client, well_formed, _endless())
    assert streamed.status == 413 and streamed.chunks_read == CAP // (64 * 1024) + 1
    assert b'"too_large"' in streamed.messages[1]["body"]
    small_head = {
        PREAUTH_HEADER: preauth_header("shuffler-1", b"{}", SHUFFLERS["shuffler-1"], time.time())
    }
    small = _drive(
        client, {**well_formed, **small_head, "Content-Type": "application/json"}, iter([b"{}"])
    )
    assert small.status == 401 and small.chunks_read == 1  # read, then its signature fails
    assert b'"bad_signature"' in small.messages[1]["body"]
    other = _drive(client, {**well_formed, "Content-Type": "application/json"}, iter([b"{}"]))
    assert other.status == 401 and b'"bad_preauth"' in other.messages[1]["body"]  # not its body


def test_publishing_checks_the_token_before_the_body(client: TestClient) -> None:
    """Without the admin token any body is a 401 (it used to be a 400 for a malformed one), and
    nothing of it is read; with the token, a body that is not UTF-8 JSON is a 400 in the one
    error shape."""
    url = "/v1/channels/homepage/releases"
    for body in (b"{", b"\xff\xfe", b'{"epoch": "x"}', b'{"epoch": 99999999999999999999999}'):
        headers = {"Content-Type": "application/json"}
        _refusal(client.post(url, content=body, headers=headers), 401, "bad_admin_token")
        wrong: dict[str, str | bytes] = {**headers, "Authorization": b"Bearer a.\xff"}
        _refusal(client.post(url, content=body, headers=wrong), 401, "bad_admin_token")
        _refusal(
            client.post(url, content=body, headers={**headers, **ADMIN}), 400, "invalid_request"
        )
    exchange = _drive(client, {"Content-Type": "application/json"}, _endless(), url)
    assert (exchange.status, exchange.chunks_read) == (401, 0)
    _refusal(client.post("/v1/channels/elsewhere/releases", content=b"{"), 401, "bad_admin_token")


def test_a_body_that_is_not_utf8_json_gets_the_error_shape(client: TestClient) -> None:
    for body in (b"\xff\xfe\x00{", b"\x80", b'{"shuffler_id": "\xc3\x28"}'):
        _refusal(_post(client, body, ANY_SIGNATURE), 401, "bad_signature")  # verified first
        detail = _refusal(_post(client, *_signed_body(body)), 400, "malformed")
        assert "JSON" in detail or "UTF-8" in detail or "utf-8" in detail


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(client: TestClient) -> None:
    """Every documented path answers an undocumented method with 405 JSON and ``Allow``."""
    paths = client.get("/openapi.json").json()["paths"]
    assert len(paths) >= 11
    for template, operations in paths.items():
        path = template.replace("{channel_id}", "homepage")
        # a CORS preflight (OPTIONS) is answered before routing, not advertised in Allow
        served = {method.upper() for method in operations} - {"OPTIONS"}
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - served:
            response = client.request(method, path)
            _refusal(response, 405, "method_not_allowed")
            allowed = {m.strip() for m in response.headers["allow"].split(",")}
            assert served <= allowed <= served | {"HEAD"}, (method, path, allowed)


def test_signed_batches_with_numbers_or_crowds_the_edge_refuses(client: TestClient) -> None:
    """A validly signed part with a count the tables cannot hold or a 10 kB crowd id is a 400,
    one with an undeclared crowd a 422, the same on every database (such parts used to be
    stored on SQLite and a storage error on PostgreSQL)."""
    batch = Batch.model_validate_json(make_batch(VALUES[:100]).body)
    huge = batch.model_copy(update={"n_contributions": 2**40})
    assert "n_contributions" in _refusal(_post(client, *signed(huge)), 400, "malformed")
    stranger = batch.model_copy(update={"crowd_id": "us"})
    _refusal(_post(client, *signed(stranger)), 422, "unknown_crowd")
    endless = batch.model_copy(update={"crowd_id": "x" * 10_000})
    assert "crowd_id" in _refusal(_post(client, *signed(endless)), 400, "malformed")
    assert _post(client, *signed(batch)).status_code == 201
