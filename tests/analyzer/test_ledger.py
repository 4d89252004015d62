"""The privacy ledger: each (channel, epoch) charged once at the crowds received, whatever is
queried or published; lifetime ε by dp_accounting PLD composition between the largest epoch and
basic composition; the lifetime across channels."""

from __future__ import annotations

import contextlib
import secrets
import threading
from typing import ClassVar

import numpy as np
import pytest
from sqlalchemy import delete

from analyzer.channels import ChannelRuntime
from analyzer.errors import UnknownChannelError
from analyzer.ledger import DELTA_HEADROOM, lifetime
from analyzer.metrics import AnalyzerEvents
from analyzer.opening import FragmentOpener, PartOpener
from analyzer.store import ReceivedRange, epoch_charges
from common.mechanisms import krappor
from common.randomness import SeededSource
from common.wire import Batch, Bound, ChannelConfig

from .helpers import CHANNEL, SHUFFLERS, VALUES, Signed, build, crowd, make_batch, seal, signed

OTHER = CHANNEL.model_copy(update={"id": "settings-page"})


def _bound(eps: float, delta: float) -> Bound:
    return Bound(
        method="test",
        eps=eps,
        delta=delta,
        neighbouring="removal",
        valid_regime=True,
        kind="certified",
        note="",
        inputs={},
    )


def _batch(channel: ChannelConfig, epoch: int, size: int) -> Signed:
    params, rng = krappor.KRapporParams(k=20, eps=4.0), SeededSource(epoch)
    fragments = seal(
        [f for v in VALUES[:size] for f in krappor.KRappor().encode_value(params, int(v), rng)],
        channel,
        epoch,
    )
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=channel.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=size,
        fragments=fragments,
    )
    return signed(batch)


def test_each_epoch_is_charged_once_whatever_the_queries(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver_all(
        *(make_batch(VALUES, epoch=epoch, seed=epoch) for epoch in (1, 2, 3)),
        make_batch(VALUES[:300], epoch=2, shuffler="shuffler-2", seed=9),
    )
    for _ in range(20):
        layers.releases.release("homepage", 1, 3)
        layers.releases.release("homepage", 2, 2)
    layers.releases.publish("homepage", 1, 3)
    layers.releases.publish("homepage", 2, 2)
    rows = layers.ledger.rows("homepage")
    assert [row.epoch for row in rows] == [1, 2, 3]
    assert [row.batches for row in rows] == [1, 2, 1]
    assert [row.n for row in rows] == [
        crowd(VALUES, 1),
        crowd(VALUES[:300], 9),  # the epoch's smaller batch
        crowd(VALUES, 3),
    ]
    assert rows[1].certificate.eps > rows[0].certificate.eps  # the smaller crowd of epoch 2
    assert len(layers.store.charges()) == 3 and layers.events.get("releases") == 2
    single = layers.releases.release("homepage", 2, 2).certificate
    assert rows[1].certificate.eps == pytest.approx(single.eps)
    with pytest.raises(UnknownChannelError):
        layers.ledger.ledger("elsewhere")


def test_lifetime_lies_between_the_largest_epoch_and_basic_composition(database_url: str) -> None:
    layers = build(database_url)
    for epoch, size in ((1, 1000), (2, 400), (3, 700), (4, 1000)):
        layers.deliver(*make_batch(VALUES[:size], epoch=epoch, seed=epoch))
    ledger = layers.ledger.ledger("homepage")
    assert ledger.lifetime is not None and ledger.lifetime.eps is not None
    epsilons = [row.certificate.eps for row in ledger.epochs]
    assert ledger.lifetime.epochs == 4 and ledger.lifetime.eps_pld is not None
    # The lifetime may be basic composition itself, summed in another order (1 ulp apart).
    assert max(epsilons) <= ledger.lifetime.eps <= sum(epsilons) + 1e-9
    # k-RAPPOR epochs enter as dominating pairs (tests/analyzer/test_lifetime_ledger.py), so
    # basic composition is over the pairs' ε at δ/T, not over the certificates.
    assert ledger.lifetime.pair_parts == 4 and ledger.lifetime.eps_basic is not None
    assert ledger.lifetime.eps <= ledger.lifetime.eps_basic <= sum(epsilons)
    split = ledger.lifetime.delta_split
    assert split.certificates == 0.0
    assert split.certificates + split.pld_pairs == pytest.approx(ledger.lifetime.delta)


def test_lifetime_across_channels_composes_every_epoch_of_every_channel(
    database_url: str,
) -> None:
    layers = build(database_url, (CHANNEL, OTHER))
    empty = layers.ledger.overview()
    assert empty.lifetime is None and empty.epochs == 0
    for epoch in (1, 2):
        layers.deliver(*_batch(CHANNEL, epoch, 600))
        layers.deliver(*_batch(OTHER, epoch, 900))
    each = [layers.ledger.ledger(c.id).lifetime for c in (CHANNEL, OTHER)]
    overview = layers.ledger.overview()
    assert overview.channels == [CHANNEL.id, OTHER.id] and overview.epochs == 4
    assert overview.lifetime is not None and overview.lifetime.eps is not None
    assert all(one is not None and one.eps is not None for one in each)
    assert max(one.eps for one in each if one and one.eps) < overview.lifetime.eps
    assert overview.lifetime.eps <= sum(one.eps_basic for one in each if one and one.eps_basic)


class _MeetingRuntime(ChannelRuntime):
    """The channel's own runtime, whose charge waits (up to 3 s) for the other writer to
    reach its charge too: two writers that both read the epoch before either commits meet
    here, and then both rewrite the ledger row from what they read."""

    meeting: ClassVar[threading.Barrier] = threading.Barrier(2, timeout=3.0)

    def charge(self, received: ReceivedRange) -> str | None:
        with contextlib.suppress(threading.BrokenBarrierError):
            self.meeting.wait()
        return super().charge(received)


@pytest.mark.slow
def test_two_analyzer_processes_charging_one_epoch_at_once_miss_no_batch(
    postgres_url: str,
) -> None:
    # Two analyzers over one PostgreSQL database (two engines, as two processes) each complete
    # a batch of the same epoch from another shuffler while the epoch is already charged: the
    # last rewrite of its ledger row must cover all three batches (one per shuffler: a group
    # sends one batch).
    first = build(postgres_url)
    first.deliver(*make_batch(VALUES, epoch=7, seed=1))
    second = build(postgres_url)
    stored = [
        first.intake.accept(*make_batch(VALUES[:600], epoch=7, seed=2, shuffler="shuffler-2")),
        first.intake.accept(*make_batch(VALUES[:500], epoch=7, seed=3, shuffler="shuffler-3")),
    ]
    base = ChannelRuntime.build(CHANNEL, sorted(SHUFFLERS))
    runtime = _MeetingRuntime(
        config=base.config, mechanism=base.mechanism, shuffler_ids=base.shuffler_ids
    )
    _MeetingRuntime.meeting.reset()
    headers = {h.batch_id: h for h in first.store.pending_parts()}
    openers = [
        PartOpener(
            layers.store,
            {CHANNEL.id: runtime},
            FragmentOpener(layers.opener.opener.ring, 1, 500),
            AnalyzerEvents(),
        )
        for layers in (first, second)
    ]
    folded: list[bool] = []
    threads = [
        threading.Thread(target=lambda o=o, s=s: folded.append(o.open_part(headers[s.batch_id])))
        for o, s in zip(openers, stored, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert folded == [True, True]
    (charge,) = first.store.charges(CHANNEL.id)
    assert charge.batches == 3
    rows = second.ledger.rows(CHANNEL.id)
    assert [row.n for row in rows] == [crowd(VALUES[:500], 3)]  # the smallest (shuffler-3)
    expected = runtime.charge(first.store.received(CHANNEL.id, "", 7, 7))
    assert charge.certificate == expected


def test_epochs_stored_before_the_ledger_are_charged_at_start(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES, epoch=5))
    charged = layers.ledger.rows("homepage")
    with layers.store.engine.begin() as conn:
        conn.execute(delete(epoch_charges))
    assert layers.ledger.rows("homepage") == []
    assert layers.ledger.charge_missing() == 1 and layers.ledger.charge_missing() == 0
    again = layers.ledger.rows("homepage")
    assert [r.certificate for r in again] == [r.certificate for r in charged]


def test_lifetime_states_a_larger_delta_when_the_epochs_exhaust_it() -> None:
    assert lifetime([]) is None
    bounds = [_bound(0.5, 4e-7)] * 3
    stated = lifetime(bounds, 1e-6)
    assert stated is not None and stated.delta == pytest.approx(DELTA_HEADROOM * 1.2e-6)
    assert "stated at" in stated.note
    within = lifetime(bounds[:2], 1e-6)
    assert within is not None and within.delta == 1e-6 and "stated at" not in within.note
    assert np.isclose(within.eps_basic or 0.0, 1.0)
