"""Releases wait for every shuffler (docs/protocol-notes.md, "Releases wait for every
shuffler"): an epoch's estimate appears only once all three shufflers serving the channel
delivered their batch for it, or once it closed at its timeout; a batch completing after the
close never changes it. Over both backends, with a clock the tests move
(epoch 7 of a 3,600 s channel, closing 60 s after its end)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from analyzer.errors import EpochsOpenError, NothingReceivedError
from analyzer.releases import Release
from common.wire import Batch

from .helpers import CHANNEL, VALUES, Clock, Layers, build, crowd, estimated, make_batch, signed
from .test_app import ADMIN
from .test_intake import _parts

#: Epoch 7 ends at 8 × 3,600 s; it closes 60 s later.
DURING, END, CLOSE_SECONDS = 7 * 3600 + 10, 8 * 3600, 60


def _layers(database_url: str, clock: Clock) -> Layers:
    return build(database_url, clock=clock, close_seconds=CLOSE_SECONDS)


def _settled_epoch_6(layers: Layers) -> Release:
    """Epoch 6 delivered by all three shufflers: released whatever epoch 7 does."""
    layers.deliver_all(
        *(make_batch(VALUES, epoch=6, shuffler=f"shuffler-{i}", seed=60 + i) for i in (1, 2, 3))
    )
    return layers.releases.release("homepage", 6, 6)


def test_an_epoch_appears_only_when_every_shuffler_delivered(database_url: str) -> None:
    clock = Clock(DURING)
    layers = _layers(database_url, clock)
    before = _settled_epoch_6(layers)
    span = layers.releases.release("homepage", 6, 7)
    assert np.array_equal(span.estimate.values, before.estimate.values)
    for delivered, shuffler in enumerate(("shuffler-1", "shuffler-2"), start=1):
        layers.deliver(*make_batch(VALUES[:200], shuffler=shuffler, seed=delivered))
        with pytest.raises(EpochsOpenError, match=f"epoch 7: {delivered}"):
            layers.releases.release("homepage", 7, 7)
        same = layers.releases.release("homepage", 6, 7)
        # the range's release does not move by one shuffler's batch: epoch 7 is left out
        assert np.array_equal(same.estimate.values, before.estimate.values)
        assert same.estimate.n == before.estimate.n
        assert f"7 ({delivered} delivered)" in same.note
        assert layers.releases.epochs("homepage") == (6, 6)  # the last settled epoch
    layers.deliver(*make_batch(VALUES[:200], shuffler="shuffler-3", seed=3))
    whole = layers.releases.release("homepage", 7, 7)
    crowds = sorted(crowd(VALUES[:200], seed) for seed in (1, 2, 3))
    assert whole.estimate.n == 600 and sorted(whole.crowds.values()) == crowds
    assert "waiting" not in whole.note
    assert layers.releases.release("homepage", 6, 7).estimate.n == before.estimate.n + 600
    assert layers.releases.epochs("homepage") == (7, 7)
    assert layers.closer.close_due() == 0  # nothing due before the timeout


def test_an_epoch_closes_at_its_timeout_and_a_later_batch_never_changes_it(
    database_url: str,
) -> None:
    clock = Clock(DURING)
    layers = _layers(database_url, clock)
    layers.deliver_all(
        make_batch(VALUES[:300], shuffler="shuffler-1", seed=1),
        make_batch(VALUES[300:600], shuffler="shuffler-2", seed=2),
    )
    clock.now = END + CLOSE_SECONDS - 1
    assert layers.closer.close_due() == 0
    with pytest.raises(EpochsOpenError):
        layers.releases.release("homepage", 7, 7)
    clock.now = END + CLOSE_SECONDS
    assert layers.closer.close_due() == 1 and layers.events.get("epochs_closed") == 1
    closed = layers.releases.release("homepage", 7, 7)
    crowds = sorted([crowd(VALUES[:300], 1), crowd(VALUES[300:600], 2)])
    assert closed.estimate.n == 600 and sorted(closed.crowds.values()) == crowds
    # shuffler-3 delivers after the close: stored and charged, never released
    layers.deliver(*make_batch(VALUES[600:900], shuffler="shuffler-3", seed=3))
    late = layers.releases.release("homepage", 7, 7)
    assert np.array_equal(late.estimate.values, closed.estimate.values)
    assert late.certificate == closed.certificate
    assert "epoch 7 from shuffler-3" in late.note
    assert layers.closer.close_due() == 0  # closed once, for good


def test_a_group_with_only_an_incomplete_batch_at_its_close_stays_closed(
    database_url: str,
) -> None:
    """A batch whose parts were not all received at the close never enters the epoch."""
    clock = Clock(DURING)
    layers = _layers(database_url, clock)
    head, tail = _parts(make_batch(VALUES, seed=4).body, 2)
    layers.deliver(*head)
    clock.now = END + CLOSE_SECONDS
    assert layers.closer.close_due() == 1
    layers.deliver(*tail)
    assert layers.store.charges("homepage")  # complete now: charged, never released
    with pytest.raises(
        NothingReceivedError, match="after the epoch closed: epoch 7 from shuffler-1"
    ):
        layers.releases.release("homepage", 7, 7)


def test_a_batch_still_arriving_holds_its_group_open(database_url: str) -> None:
    """A part received within the close timeout of the moment holds the close back: the
    batch is being delivered; once it completes, the group closes with it."""
    clock = Clock(END + CLOSE_SECONDS - 5)
    layers = _layers(database_url, clock)
    head, tail = _parts(make_batch(VALUES[:300], seed=4).body, 2)
    layers.deliver(*head)
    clock.now = END + CLOSE_SECONDS + 30
    assert layers.closer.close_due() == 0
    layers.deliver(*tail)  # complete: the closer that runs after it closes the group
    assert layers.events.get("epochs_closed") == 1
    assert layers.store.closures("homepage", "", 7, 7) == {7: frozenset({"shuffler-1"})}
    assert layers.releases.release("homepage", 7, 7).estimate.n == estimated(VALUES[:300], 4)


def test_a_batch_trickled_part_by_part_holds_its_group_for_one_more_timeout_at_most(
    database_url: str,
) -> None:
    """A shuffler that sends one part of a big batch just before each timeout would keep the
    epoch out of every release for good: one timeout after its first part, the group closes
    whatever arrives."""
    clock = Clock(END + CLOSE_SECONDS - 5)
    layers = _layers(database_url, clock)
    whole = make_batch(VALUES[:300], seed=4)
    parts = _parts(whole.body, 3)
    layers.deliver(*parts[0])
    clock.now = END + 2 * CLOSE_SECONDS - 6
    layers.deliver(*parts[1])  # still arriving: the group stays open
    assert layers.closer.close_due() == 0
    clock.now = END + 2 * CLOSE_SECONDS - 5
    assert layers.closer.close_due() == 1
    layers.deliver(*parts[2])  # complete after the close: charged, never released
    with pytest.raises(NothingReceivedError, match="after the epoch closed"):
        layers.releases.release("homepage", 7, 7)


def test_a_batch_delivered_long_after_its_epoch_completes_and_is_released(
    database_url: str,
) -> None:
    """A shuffler back from an outage delivers an epoch whose timeouts all passed: its batch,
    arriving part by part, is not cut by the close; the group settles once it is complete."""
    clock = Clock(END + 5 * CLOSE_SECONDS)
    layers = _layers(database_url, clock)
    parts = _parts(make_batch(VALUES[:300], seed=5).body, 3)
    layers.deliver(*parts[0])
    clock.now += CLOSE_SECONDS / 2
    assert layers.closer.close_due() == 0
    layers.deliver(*parts[1])
    layers.deliver(*parts[2])
    clock.now += 1
    assert layers.closer.close_due() in (0, 1)  # complete: it settled with its batch
    assert layers.releases.release("homepage", 7, 7).estimate.n == estimated(VALUES[:300], 5)


def test_a_group_waits_for_the_opener_before_it_closes(database_url: str) -> None:
    """A part stored before the close but not opened yet holds the close back: it arrived in
    time, only the opener is behind."""
    clock = Clock(DURING)
    layers = _layers(database_url, clock)
    layers.intake.accept(*make_batch(VALUES[:300], shuffler="shuffler-1", seed=1))
    clock.now = END + CLOSE_SECONDS
    assert layers.closer.close_due() == 0
    layers.opener.open_pending()
    assert layers.closer.close_due() == 1
    assert layers.releases.release("homepage", 7, 7).estimate.n == estimated(VALUES[:300], 1)


def test_a_withheld_batch_counts_as_delivered(database_url: str) -> None:
    """A shuffler whose batch verifies below min_crowd has spoken for the epoch: the epoch
    settles with the other two shufflers' batches, the withheld one adding nothing."""
    clock = Clock(DURING)
    layers = _layers(database_url, clock)
    layers.deliver_all(
        make_batch(VALUES[:300], shuffler="shuffler-1", seed=1),
        make_batch(VALUES[300:600], shuffler="shuffler-2", seed=2),
    )
    with pytest.raises(EpochsOpenError):
        layers.releases.release("homepage", 7, 7)
    alone = make_batch(VALUES[:1], shuffler="shuffler-3", seed=3)
    boast = Batch.model_validate_json(alone.body).model_copy(update={"n_contributions": 1000})
    layers.deliver(*signed(boast))
    release = layers.releases.release("homepage", 7, 7)
    assert release.estimate.n == estimated(VALUES[:300], 1) + estimated(VALUES[300:600], 2)
    assert release.crowd_check is not None and release.crowd_check.withheld == 1


def test_over_http_an_open_epoch_is_404_epoch_open_and_the_dashboard_shows_nothing(
    client: TestClient,
) -> None:
    """The app with its background closer: the current epoch has not ended, so one shuffler's
    batch of it shows nowhere public."""
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    part = make_batch(VALUES, epoch=epoch)
    assert client.post("/v1/batches", content=part.body, headers=part.headers).status_code == 201
    service = client.app.state.service  # type: ignore[attr-defined]
    service.opener.open_pending()
    service.closer.close_due()
    answer = client.get(f"/v1/channels/homepage/estimate?epoch={epoch}")
    assert answer.status_code == 404 and answer.json()["error"] == "epoch_open"
    assert f"epoch {epoch}: 1" in answer.json()["detail"]
    assert client.get("/v1/channels/homepage/estimate").json()["error"] == "epoch_open"
    page = client.get("/").text
    assert "Nothing released yet" in page and "<svg" not in page


def test_an_admin_closes_an_epoch_at_the_analyzer_before_its_timeout(client: TestClient) -> None:
    """``POST /v1/admin/channels/{id}/close``: what a loadtest or the demo calls once every
    shuffler has forwarded, so an epoch one shuffler held is released without waiting an hour;
    only with the analyzer's admin token (a shuffler has none)."""
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    part = make_batch(VALUES, epoch=epoch)
    assert client.post("/v1/batches", content=part.body, headers=part.headers).status_code == 201
    service = client.app.state.service  # type: ignore[attr-defined]
    service.opener.open_pending()
    close = "/v1/admin/channels/homepage/close"
    assert client.post(close, json={"epoch": epoch}).status_code == 401
    assert client.get(f"/v1/channels/homepage/estimate?epoch={epoch}").status_code == 404
    closed = client.post(close, json={"epoch": epoch}, headers=ADMIN)
    assert closed.status_code == 200, closed.text
    assert closed.json() == {
        "channel_id": "homepage",
        "epoch": epoch,
        "closed": [{"epoch": epoch, "crowd_id": "", "shufflers": ["shuffler-1"]}],
    }
    assert client.get(f"/v1/channels/homepage/estimate?epoch={epoch}").json()["n"] == estimated(
        VALUES
    )
    assert client.post(close, json={"epoch": epoch}, headers=ADMIN).json()["closed"] == []
    late = make_batch(VALUES, epoch=epoch, shuffler="shuffler-2", seed=2)
    assert client.post("/v1/batches", content=late.body, headers=late.headers).status_code == 201
    service.opener.open_pending()
    after = client.get(f"/v1/channels/homepage/estimate?epoch={epoch}").json()
    assert (
        after["n"] == estimated(VALUES)
        and "epoch " + str(epoch) + " from shuffler-2" in after["note"]
    )
    unknown = client.post("/v1/admin/channels/nowhere/close", json={"epoch": 1}, headers=ADMIN)
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_channel"
    bad = client.post(close, json={"epoch": -1}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"
