"""Per-channel health at a shuffler (``esa_shuffler_channel_groups{channel, epoch, outcome}`` and
``esa_shuffler_channel_contributions{channel, epoch, stage}``): released, held and pending groups
on a real store, both databases. The released groups' contributions are exact (received as put
in, batched as counted in the batch's signed parts, deleted the rest, forwarded as acknowledged);
a held group shows only as one held group, never its size; a waiting group shows nothing; each
channel shows its ``CHANNEL_EPOCHS`` newest epochs. Then the same through the app's ``/metrics``
(behind its token) over the same database."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from common.envelope import Contribution, KeyRing, new_nonce, seal_contribution
from common.randomness import SeededSource
from common.wire import Batch, ChannelPolicy
from runtime import db
from shuffler import tables
from shuffler.app import MIGRATIONS, create_app
from shuffler.metrics import CHANNEL_EPOCHS, ShufflerCollector
from shuffler.records import PartKey
from shuffler.service import ShufflerService
from shuffler.settings import ShufflerSettings
from shuffler.store_backends import make_store

from .factory import EPOCH_SECONDS, Clock

#: A shift of ln(2/δ) ≈ 14.5 contributions: a group of 30 is released with about half of it
#: deleted, groups of 1 and 3 are held (below ``min_crowd``), and one aborts with probability
#: δ/2 (the outcomes are asserted from the groups table, not assumed).
HOMEPAGE = ChannelPolicy(
    id="homepage",
    epoch_seconds=EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=2.0,
    delta_cr=1e-6,
    max_fragments=8,
    crowds=("", "eu"),
)
SETTINGS_PAGE = HOMEPAGE.model_copy(update={"id": "settings-page"})
FRAGMENTS = 2
#: An epoch far ahead of the wall clock: the app's own background batching, forwarding and
#: retention (real time) never touch what this test evaluated or left waiting.
FIRST = 1_200_000
RELEASED, HELD, PENDING = 30, 3, 7
METRICS_TOKEN = "metrics-secret"


def _settings(url: str, tmp_path: Path, name: str) -> ShufflerSettings:
    return ShufflerSettings(
        database_url=url,
        key_dir=tmp_path / name,
        channels=[HOMEPAGE, SETTINGS_PAGE],
        metrics_token=METRICS_TOKEN,
    )


def _service(url: str, tmp_path: Path) -> tuple[ShufflerService, Clock]:
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    clock = Clock()
    service = ShufflerService(
        _settings(url, tmp_path, "keys"),
        make_store(engine),
        KeyRing.of(X25519PrivateKey.generate()),
        Ed25519PrivateKey.generate(),
        clock,
        SeededSource(3),
    )
    return service, clock


def _contribute(
    service: ShufflerService, clock: Clock, epoch: int, count: int, channel: str, crowd: str = ""
) -> None:
    """``count`` contributions from fresh clients to a group, sent during its epoch."""
    clock.now = epoch * EPOCH_SECONDS + 100.0
    for _ in range(count):
        contribution = Contribution(
            channel_id=channel,
            crowd_id=crowd,
            epoch=epoch,
            nonce=new_nonce(),
            fragments=tuple(bytes([i]) * 72 for i in range(FRAGMENTS)),
        )
        blob = seal_contribution(contribution, service.settings.shuffler_id, service.ring.public())
        stored = service.commit([service.validate(service.admit(service.tokens.issue()), blob)])[0]
        assert stored.receipt


def _batch(service: ShufflerService, channel: str, epoch: int) -> tuple[str, list[Batch]]:
    """A released group's batch id and its signed parts, as they will be sent."""
    b, bodies = tables.batches.c, tables.part_bodies.c
    with service.store.engine.connect() as conn:
        batch_id = conn.execute(
            select(b.batch_id).where(b.channel_id == channel, b.epoch == epoch)
        ).scalar_one()
        rows = conn.execute(select(bodies.body).where(bodies.batch_id == batch_id)).scalars()
        return batch_id, [Batch.model_validate_json(bytes(body)) for body in rows]


def _outcomes(service: ShufflerService) -> dict[tuple[str, str, int], str]:
    g = tables.groups.c
    with service.store.engine.connect() as conn:
        rows = conn.execute(select(g.channel_id, g.crowd_id, g.epoch, g.status)).all()
    return {(channel, crowd, int(epoch)): status for channel, crowd, epoch, status in rows}


def _samples(text: str) -> dict[tuple[str, str, str, str], float]:
    """The per-channel samples of a scrape: (metric, channel, epoch, outcome or stage) → value."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("esa_shuffler_channel_groups", "esa_shuffler_channel_contributions"):
            for sample in family.samples:
                labels = sample.labels
                kind = labels.get("outcome") or labels["stage"]
                found[family.name, labels["channel"], labels["epoch"], kind] = sample.value
    return found


def _truth(service: ShufflerService, clock: Clock) -> dict[tuple[str, str, str, str], float]:
    """Fill and evaluate the groups, and what a scrape must then show (from what was put in
    and what the batches carry): the settings page has one held contribution in each of
    CHANNEL_EPOCHS + 1 epochs; the homepage a released and a held group in one epoch, a
    released group whose batch the analyzer acknowledged in the next, and a waiting group."""
    spread = range(FIRST, FIRST + CHANNEL_EPOCHS + 1)
    for epoch in spread:
        _contribute(service, clock, epoch, 1, SETTINGS_PAGE.id)
    mixed, forwarded, waiting = spread[-2], spread[-1], spread[-1] + 1
    _contribute(service, clock, mixed, RELEASED, HOMEPAGE.id)
    _contribute(service, clock, mixed, HELD, HOMEPAGE.id, crowd="eu")
    _contribute(service, clock, forwarded, RELEASED, HOMEPAGE.id)
    _contribute(service, clock, waiting, PENDING, HOMEPAGE.id)
    assert service.run_batching() == len(spread) + 3
    outcomes = _outcomes(service)
    assert outcomes == {
        **{(SETTINGS_PAGE.id, "", epoch): "held" for epoch in spread},
        (HOMEPAGE.id, "", mixed): "released",
        (HOMEPAGE.id, "eu", mixed): "held",
        (HOMEPAGE.id, "", forwarded): "released",
    }
    batch_id, parts = _batch(service, HOMEPAGE.id, forwarded)
    for part in parts:
        service.store.record_forwarded(PartKey(batch_id, part.part), clock.now)
    truth: dict[tuple[str, str, str, str], float] = {}
    groups, contributions = "esa_shuffler_channel_groups", "esa_shuffler_channel_contributions"
    for epoch in spread[1:]:  # the CHANNEL_EPOCHS newest: the first is left out
        label = str(epoch)
        for outcome, count in (("released", 0), ("held", 1), ("aborted", 0)):
            truth[groups, SETTINGS_PAGE.id, label, outcome] = count
        for stage in ("received", "deleted", "batched", "forwarded"):
            truth[contributions, SETTINGS_PAGE.id, label, stage] = 0
    for epoch, held, sent in ((mixed, 1, False), (forwarded, 0, True)):
        label = str(epoch)
        _, parts = _batch(service, HOMEPAGE.id, epoch)
        batched = sum(len(part.fragments) for part in parts) // FRAGMENTS
        assert 0 < batched < RELEASED
        truth |= {
            (groups, HOMEPAGE.id, label, "released"): 1,
            (groups, HOMEPAGE.id, label, "held"): held,
            (groups, HOMEPAGE.id, label, "aborted"): 0,
            (contributions, HOMEPAGE.id, label, "received"): RELEASED,  # the held 3 are not in
            (contributions, HOMEPAGE.id, label, "deleted"): RELEASED - batched,
            (contributions, HOMEPAGE.id, label, "batched"): batched,
            (contributions, HOMEPAGE.id, label, "forwarded"): batched if sent else 0,
        }
    return truth


def test_only_released_groups_show_their_sizes(database_url: str, tmp_path: Path) -> None:
    service, clock = _service(database_url, tmp_path)
    registry = CollectorRegistry(auto_describe=True)
    store = service.store
    registry.register(
        ShufflerCollector(service.events, store.ledger_by_cause, store.channel_health)
    )
    assert _samples(generate_latest(registry).decode()) == {}  # nothing evaluated yet
    truth = _truth(service, clock)
    assert _samples(generate_latest(registry).decode()) == truth
    # No epoch of the waiting group, and nothing of any crowd: labels are channel and epoch.
    assert all(int(epoch) < FIRST + CHANNEL_EPOCHS + 1 for _, _, epoch, _ in truth)
    newest = store.channel_health(2)
    assert [(row.channel_id, row.epoch) for row in newest] == [
        (HOMEPAGE.id, FIRST + CHANNEL_EPOCHS),
        (HOMEPAGE.id, FIRST + CHANNEL_EPOCHS - 1),
        (SETTINGS_PAGE.id, FIRST + CHANNEL_EPOCHS),
        (SETTINGS_PAGE.id, FIRST + CHANNEL_EPOCHS - 1),
    ]
    with pytest.raises(ValueError, match="epochs=0"):
        store.channel_health(0)


def test_the_app_serves_them_behind_its_metrics_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = _service(url, tmp_path)
    truth = _truth(service, clock)
    service.store.close()  # lets go of the file's writer lock: the app below writes to it
    service.store.engine.dispose()
    with TestClient(create_app(_settings(url, tmp_path, "app-keys"))) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"] == "bad_metrics_token"
        scrape = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert scrape.status_code == 200
        assert _samples(scrape.text) == truth
