"""Per-channel health at the analyzer (``esa_analyzer_channel_*{channel, epoch}`` and the
dashboard's health table): per channel and epoch, what was stored — the crowd the batches
claim (complete or not), the crowd the complete ones verify, batches complete, withheld and
incomplete, parts quarantined, chaff and releases published over the epoch — compared with what
the test put in. Each channel shows its ``CHANNEL_EPOCHS`` newest epochs on ``/metrics``; a
channel is whatever the stored batches name. In-process: the store on both databases, then
the app (``GET /metrics`` and ``GET /``) over SQLite."""

from __future__ import annotations

import base64
import re
import secrets
from dataclasses import asdict
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from analyzer.app import create_app
from analyzer.dashboard import DASHBOARD_EPOCHS
from analyzer.metrics import CHANNEL_EPOCHS, EventsCollector
from analyzer.opening import OPEN_ATTEMPTS
from analyzer.settings import AnalyzerSettings
from common.wire import Batch, ShufflerEntry, b64

from .helpers import (
    ANALYZER_KEY,
    CHANNEL,
    SHUFFLERS,
    VALUES,
    Layers,
    Signed,
    build,
    crowd,
    make_batch,
    reports,
    seal,
    seeded_entry,
    signed,
)

#: A second channel with a small crowd threshold, one batch of :data:`SMALL` in each of its
#: CHANNEL_EPOCHS + 1 epochs (the first must be left out of ``/metrics``).
OTHER = CHANNEL.model_copy(update={"id": "settings-page", "min_crowd": 5})
SMALL = 5
SPREAD = range(100, 100 + CHANNEL_EPOCHS + 1)
CHAFF, WITHHELD_CHAFF = 5, 20
FIELDS = (
    "received",
    "verified",
    "batches_complete",
    "batches_withheld",
    "batches_incomplete",
    "parts_quarantined",
    "fragments_invalid",
    "releases",
)
Truth = dict[tuple[str, int], dict[str, int]]


def _row(**counts: int) -> dict[str, int]:
    return {field: counts.get(field, 0) for field in FIELDS}


def _other_batch(epoch: int) -> Signed:
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=OTHER.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=SMALL,
        fragments=seal(reports(VALUES[:SMALL], seed=epoch), OTHER, epoch),
    )
    return signed(batch)


def _short_batch(epoch: int) -> Signed:
    """A batch claiming min_crowd contributions that carries one fewer, padded with chaff to
    the fragments the claim allows: its verified crowd is below min_crowd (withheld)."""
    fragments = seal(reports(VALUES[: CHANNEL.min_crowd - 1], seed=9), CHANNEL, epoch)
    size = len(base64.b64decode(fragments[0]))
    fragments += [b64(secrets.token_bytes(size)) for _ in range(WITHHELD_CHAFF)]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=CHANNEL.min_crowd,
        fragments=fragments,
    )
    return signed(batch)


def _store_everything(layers: Layers, waiting: bool = True) -> Truth:
    """Deliver the batches (opened, or quarantined, and with ``waiting`` one left stored) and
    publish two releases; what each (channel, epoch) must then show. The verified crowds follow
    the documented rule: what the valid fragments prove, never more than the claim less one
    contribution per ``max_fragments`` invalid fragments (rounded up)."""
    layers.deliver(*make_batch(VALUES[:300], epoch=7, chaff=CHAFF))
    layers.deliver(*make_batch(VALUES[300:500], epoch=7, shuffler="shuffler-2"))
    layers.deliver(*make_batch(VALUES[500:600], epoch=8))
    layers.deliver(*_short_batch(9))
    for epoch in SPREAD:
        layers.deliver(*_other_batch(epoch))
    layers.releases.publish(CHANNEL.id, 7, 7)
    layers.releases.publish(CHANNEL.id, 7, 8)
    # Two more batches of epoch 8: one waits (or is opened), one is quarantined.
    late = make_batch(VALUES[600:660], epoch=8, shuffler="shuffler-2")
    if waiting:
        layers.intake.accept(*late)
    else:
        layers.deliver(*late)
    layers.intake.accept(*make_batch(VALUES[660:730], epoch=8, shuffler="shuffler-3"))
    (quarantine,) = [h for h in layers.store.pending_parts() if h.shuffler_id == "shuffler-3"]
    for _ in range(OPEN_ATTEMPTS):
        layers.store.record_failure(quarantine, "cannot open", OPEN_ATTEMPTS)
    late_crowd = crowd(VALUES[600:660])  # below min_crowd: withheld once opened
    assert late_crowd < CHANNEL.min_crowd
    truth = {
        (CHANNEL.id, 7): _row(
            received=500,
            verified=crowd(VALUES[:300], invalid=CHAFF) + crowd(VALUES[300:500]),
            batches_complete=2,
            fragments_invalid=CHAFF,
            releases=2,
        ),
        (CHANNEL.id, 8): _row(
            received=100 + 60 + 70,
            verified=crowd(VALUES[500:600]),
            batches_complete=1 if waiting else 2,
            batches_withheld=0 if waiting else 1,
            batches_incomplete=2 if waiting else 1,
            parts_quarantined=1,
            releases=1,
        ),
        (CHANNEL.id, 9): _row(
            received=CHANNEL.min_crowd,  # the claim: at least min_crowd, or refused at intake
            verified=0,  # below min_crowd: shown only as a withheld batch
            batches_complete=1,
            batches_withheld=1,
        ),
    }
    for epoch in SPREAD:
        small = crowd(VALUES[:SMALL], epoch)
        kept = small >= OTHER.min_crowd
        truth[OTHER.id, epoch] = _row(
            received=SMALL,
            verified=small if kept else 0,
            batches_complete=1,
            batches_withheld=int(not kept),
        )
    return truth


def _newest(truth: Truth, epochs: int) -> Truth:
    """``truth`` cut to each channel's ``epochs`` newest epochs."""
    kept: Truth = {}
    for channel in {c for c, _ in truth}:
        newest = sorted((e for c, e in truth if c == channel), reverse=True)[:epochs]
        kept |= {(channel, e): truth[channel, e] for e in newest}
    return kept


def _scraped(text: str) -> Truth:
    """The per-channel families of a scrape, as (channel, epoch) → the EpochHealth fields."""
    fields = {
        ("esa_analyzer_channel_contributions", "received"): "received",
        ("esa_analyzer_channel_contributions", "verified"): "verified",
        ("esa_analyzer_channel_batches", "complete"): "batches_complete",
        ("esa_analyzer_channel_batches", "withheld"): "batches_withheld",
        ("esa_analyzer_channel_batches", "incomplete"): "batches_incomplete",
        ("esa_analyzer_channel_parts_quarantined", ""): "parts_quarantined",
        ("esa_analyzer_channel_fragments_invalid", ""): "fragments_invalid",
        ("esa_analyzer_channel_releases", ""): "releases",
    }
    found: Truth = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("stage") or sample.labels.get("state") or ""
            field = fields.get((family.name, kind))
            if field is not None:
                key = (sample.labels["channel"], int(sample.labels["epoch"]))
                found.setdefault(key, {})[field] = int(sample.value)
    return found


def test_health_is_what_was_stored_per_channel_and_epoch(database_url: str) -> None:
    layers = build(database_url, (CHANNEL, OTHER))
    registry = CollectorRegistry(auto_describe=True)
    health = layers.store.channel_health
    registry.register(EventsCollector(layers.events, layers.store.unopened_parts, None, health))
    assert health(CHANNEL_EPOCHS) == [] and _scraped(generate_latest(registry).decode()) == {}
    truth = _store_everything(layers)

    rows = health(DASHBOARD_EPOCHS)
    assert {(r.channel_id, r.epoch): {f: getattr(r, f) for f in FIELDS} for r in rows} == truth
    assert [(r.channel_id, r.epoch) for r in rows] == sorted(
        truth, key=lambda key: (key[0], -key[1])
    )  # by channel, newest epoch first
    assert all(set(asdict(r)) == {"channel_id", "epoch", *FIELDS} for r in rows)
    scraped = _scraped(generate_latest(registry).decode())
    assert scraped == _newest(truth, CHANNEL_EPOCHS)
    assert (OTHER.id, SPREAD[0]) not in scraped and len(SPREAD) == CHANNEL_EPOCHS + 1
    two = health(2)
    assert [(r.channel_id, r.epoch) for r in two] == [
        (CHANNEL.id, 9),
        (CHANNEL.id, 8),
        (OTHER.id, SPREAD[-1]),
        (OTHER.id, SPREAD[-2]),
    ]


def test_the_app_shows_health_on_metrics_and_the_dashboard(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "hpke.pem").write_bytes(
        ANALYZER_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    url = f"sqlite:///{tmp_path / 'analyzer.db'}"
    # Nothing left waiting: the app's own opener would open it at any moment.
    truth = _store_everything(build(url, (CHANNEL, OTHER)), waiting=False)
    settings = AnalyzerSettings(
        database_url=url,
        key_dir=keys,
        channels=[CHANNEL, OTHER],
        channels_file=None,
        shufflers=[ShufflerEntry.model_validate(seeded_entry(n, k)) for n, k in SHUFFLERS.items()],
        shufflers_file=None,
        opening_processes=1,
    )
    with TestClient(create_app(settings)) as client:
        scrape = client.get("/metrics")
        assert scrape.status_code == 200
        assert _scraped(scrape.text) == _newest(truth, CHANNEL_EPOCHS)
        page = client.get("/")
        assert page.status_code == 200
    assert _dashboard(page.text) == _newest(truth, DASHBOARD_EPOCHS)


def _dashboard(html: str) -> Truth:
    """Each channel section's health table, as (channel, epoch) → the EpochHealth fields (the
    columns: epoch, complete, withheld, incomplete, received, verified, quarantined, invalid,
    releases), newest epoch first within a section."""
    columns = (
        "batches_complete",
        "batches_withheld",
        "batches_incomplete",
        "received",
        "verified",
        "parts_quarantined",
        "fragments_invalid",
        "releases",
    )
    found: Truth = {}
    for channel, section in re.findall(r'<section id="([^"]+)">(.*?)</section>', html, re.S):
        table = re.search(r'<table class="health">(.*?)</table>', section, re.S)
        assert table is not None, channel
        epochs = []
        for row in re.findall(r'<tr class="health-epoch">(.*?)</tr>', table.group(1)):
            cells = [int(c.replace(",", "")) for c in re.findall(r"<td[^>]*>([^<]*)</td>", row)]
            epochs.append(cells[0])
            found[channel, cells[0]] = dict(zip(columns, cells[1:], strict=True))
        assert epochs == sorted(epochs, reverse=True), channel
    return found


def test_a_channel_with_nothing_received_has_no_rows_and_epochs_must_be_positive() -> None:
    layers = build("sqlite://", (CHANNEL, OTHER))
    layers.deliver(*_other_batch(3))
    rows = layers.store.channel_health(1)
    assert [(r.channel_id, r.epoch, r.received) for r in rows] == [(OTHER.id, 3, SMALL)]
    with pytest.raises(ValueError, match="epochs=0"):
        layers.store.channel_health(0)
