"""Channels added and retired while the analyzer runs (``POST /v1/admin/channels``,
``.../retire``): published in the next signed config revision, used for batches at once, seen
by a second analyzer over the same database, kept across a restart; a changed live channel is
refused."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from analyzer.app import create_app
from analyzer.settings import AnalyzerSettings
from common.collection import verify_config
from common.envelope import load_ed25519_public
from common.wire import Batch, SignedConfig, unb64

from .helpers import CHANNEL, VALUES, reports, seal, signed

ADMIN = {"Authorization": "Bearer development"}
SEARCH = CHANNEL.model_copy(update={"id": "search", "title": "Searches"})


def _added(client: TestClient, channel: dict[str, Any]) -> Any:
    return client.post("/v1/admin/channels", json=channel, headers=ADMIN)


def _config(client: TestClient) -> Any:
    """The signed config as a device reads it (its signature checked)."""
    document = SignedConfig.model_validate(client.get("/v1/config").json())
    key = load_ed25519_public(unb64(document.config["analyzer"]["signing_key"]))
    return verify_config(document, key, time.time())


def test_an_added_channel_is_published_in_a_new_revision_and_takes_batches(
    client: TestClient,
) -> None:
    before = _config(client)
    assert before.revision == 0 and [c.id for c in before.channels] == ["homepage"]
    answer = _added(client, SEARCH.model_dump(mode="json"))
    assert answer.status_code == 201, answer.text
    assert answer.json()["changed"] is True and answer.json()["revision"] == 1
    after = _config(client)
    assert after.revision == 1 and after.channel("search") == SEARCH
    listed = client.get("/v1/channels").json()
    assert listed["revision"] == 1 and [c["id"] for c in listed["channels"]] == [
        "homepage",
        "search",
    ]
    fragments = seal(reports(VALUES[:100]), SEARCH, 7)
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id="search",
        crowd_id="",
        epoch=7,
        n_contributions=100,
        fragments=fragments,
    )
    part = signed(batch)
    stored = client.post("/v1/batches", content=part.body, headers=part.headers)
    assert stored.status_code == 201, stored.text
    client.app.state.service.opener.open_pending()  # type: ignore[attr-defined]
    estimate = client.get("/v1/channels/search/estimate?epoch=7")
    assert estimate.status_code == 200 and estimate.json()["n"] == 100


def test_adding_again_changes_nothing_and_a_changed_live_channel_is_refused(
    client: TestClient,
) -> None:
    assert _added(client, SEARCH.model_dump(mode="json")).status_code == 201
    again = _added(client, SEARCH.model_dump(mode="json"))
    assert again.status_code == 200 and again.json() == {**again.json(), "changed": False}
    assert again.json()["revision"] == 1
    for field, value in (("min_crowd", 10), ("params", {"k": 20, "eps": 8.0})):
        changed = _added(client, {**SEARCH.model_dump(mode="json"), field: value})
        assert changed.status_code == 409, changed.text
        assert changed.json()["error"] == "channel_exists" and field in changed.json()["detail"]
    homepage = _added(client, {**CHANNEL.model_dump(mode="json"), "delta": 1e-6})
    assert homepage.status_code == 409 and "delta" in homepage.json()["detail"]
    invalid = _added(client, {**SEARCH.model_dump(mode="json"), "id": "bad", "params": {"k": 1}})
    assert invalid.status_code == 400 and invalid.json()["error"] == "invalid_channel"
    unauthenticated = client.post("/v1/admin/channels", json=SEARCH.model_dump(mode="json"))
    assert unauthenticated.status_code == 401
    assert _config(client).revision == 1


def test_a_retired_channel_stops_at_its_next_epoch_and_keeps_its_reads(
    client: TestClient,
) -> None:
    retired = client.post("/v1/admin/channels/homepage/retire", headers=ADMIN)
    assert retired.status_code == 200, retired.text
    now_epoch = int(time.time() // CHANNEL.epoch_seconds)
    assert retired.json()["channel"]["retired_from_epoch"] in (now_epoch + 1, now_epoch + 2)
    assert retired.json()["changed"] is True
    published = _config(client).channel("homepage")
    assert published is not None and published.retired_from_epoch is not None
    again = client.post("/v1/admin/channels/homepage/retire", headers=ADMIN)
    assert again.json()["changed"] is False and again.json()["revision"] == 1
    unknown = client.post("/v1/admin/channels/nowhere/retire", headers=ADMIN)
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_channel"
    assert client.get("/v1/channels/homepage/privacy").status_code == 200


@pytest.fixture
def replica(client: TestClient) -> Iterator[TestClient]:
    """A second analyzer process of the same trust domain: same settings and database."""
    settings: AnalyzerSettings = client.app.state.service.settings  # type: ignore[attr-defined]
    with TestClient(create_app(settings), raise_server_exceptions=False) as second:
        yield second


def test_a_replica_and_a_restart_serve_the_channels_added_elsewhere(
    client: TestClient, replica: TestClient, tmp_path: Path
) -> None:
    assert _added(client, SEARCH.model_dump(mode="json")).status_code == 201
    assert client.post("/v1/admin/channels/homepage/retire", headers=ADMIN).status_code == 200
    seen = _config(replica)
    assert seen.revision == 2 and seen.channel("search") == SEARCH
    homepage = seen.channel("homepage")
    assert homepage is not None and homepage.retired_from_epoch is not None
    assert replica.get("/v1/channels/search/privacy").status_code == 200
