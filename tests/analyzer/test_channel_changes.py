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
from sqlalchemy import insert

from analyzer.app import create_app
from analyzer.catalog import ChannelCatalog
from analyzer.errors import InvalidChannelError
from analyzer.service import MIGRATIONS
from analyzer.settings import AnalyzerSettings
from analyzer.store import ADD, AnalyzerStore, channel_changes
from common.collection import verify_config
from common.envelope import load_ed25519_public
from common.wire import Batch, ChannelConfig, SignedConfig, unb64
from runtime import db

from .helpers import CHANNEL, VALUES, estimated, reports, seal, signed

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
    client.app.state.service.closer.close_due()  # type: ignore[attr-defined]
    estimate = client.get("/v1/channels/search/estimate?epoch=7")
    assert estimate.status_code == 200 and estimate.json()["n"] == estimated(VALUES[:100])


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
    taken = _added(client, CHANNEL.model_dump(mode="json"))  # a retired id is not taken again
    assert taken.status_code == 409 and "new id" in taken.json()["detail"]
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


def _catalog(
    tmp_path: Path, configured: list[ChannelConfig], clock: float, url: str | None = None
) -> ChannelCatalog:
    engine = db.make_engine(url or f"sqlite:///{tmp_path / 'a.db'}")
    db.upgrade(engine, MIGRATIONS)
    store = AnalyzerStore(engine, lambda: clock)
    catalog = ChannelCatalog(configured, ["shuffler-1"], store, lambda: clock, 8 * 2**20)
    catalog.refresh()
    return catalog


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_change_that_commits_after_a_later_one_is_folded_in(
    tmp_path: Path, dialect: str, request: pytest.FixtureRequest
) -> None:
    url = None if dialect == "sqlite" else request.getfixturevalue("postgres_url")
    catalog = _catalog(tmp_path, [CHANNEL], 1e9, url)

    def logged(version: int, channel: ChannelConfig) -> None:
        row = {"channel_id": channel.id, "action": ADD, "config": channel.model_dump_json()}
        with catalog.store.engine.begin() as conn:
            conn.execute(insert(channel_changes).values(version=version, changed_at=1e9, **row))

    logged(2, SEARCH)  # committed first, though its version was taken second
    assert catalog.refresh() == 2 and "search" in catalog.table
    logged(1, SEARCH.model_copy(update={"id": "late"}))
    assert catalog.refresh() == 2 and "late" in catalog.table
    catalog.store.engine.dispose()


def test_a_channel_file_that_changes_a_channel_added_at_runtime_is_refused(
    tmp_path: Path,
) -> None:
    _catalog(tmp_path, [CHANNEL], 1e9).add(SEARCH)
    changed = SEARCH.model_copy(update={"min_crowd": 2})
    with pytest.raises(InvalidChannelError, match="differs from the channel added at runtime"):
        _catalog(tmp_path, [CHANNEL, changed], 1e9)
    same = _catalog(tmp_path, [CHANNEL, SEARCH], 1e9)
    assert same.table["search"].config == SEARCH


@pytest.mark.parametrize(("into_epoch", "later"), [(0.0, 1), (3600 - 61, 1), (3600 - 59, 2)])
def test_a_channel_retired_near_its_epochs_end_is_retired_from_the_one_after(
    tmp_path: Path, into_epoch: float, later: int
) -> None:
    start = 1000 * CHANNEL.epoch_seconds
    catalog = _catalog(tmp_path, [CHANNEL], start + into_epoch)
    retired, _ = catalog.retire("homepage")
    assert retired.retired_from_epoch == 1000 + later


def test_a_title_is_at_most_200_characters(client: TestClient) -> None:
    long = {**SEARCH.model_dump(mode="json"), "title": "t" * 201}
    assert _added(client, long).status_code == 400
