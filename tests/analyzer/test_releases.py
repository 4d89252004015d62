"""Releases over both backends: estimates cover the truth, certificates match the accountant,
ranges compose, restarts keep everything, longitudinal channels certify by period."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest

from analyzer.channels import ChannelRuntime
from analyzer.errors import InvalidChannelError, NothingReceivedError, UnknownChannelError
from common.accounting import BinaryRR, certify
from common.mechanisms import longitudinal
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig

from .helpers import CHANNEL, VALUES, Clock, build, crowd, estimated, make_batch, seal, signed


def test_estimates_cover_the_truth_and_certificates_match_the_accountant(
    database_url: str,
) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES))
    release = layers.releases.release("homepage", 7, 7)
    n = crowd(VALUES)  # the lower bound the fragments prove, a few percent below the claim
    assert n < release.estimate.n == VALUES.size  # the estimate rests on the honest claim
    truth = np.bincount(VALUES, minlength=20)
    lo, hi = release.estimate.interval()
    assert np.mean((lo <= truth) & (truth <= hi)) >= 0.85
    expected = certify(BinaryRR(), 4.0, n, 1e-8)
    assert release.certificate.eps == pytest.approx(expected.certified.eps)
    assert release.certificate.method == expected.certified.method
    shown = release.to_wire()
    assert shown.other_notion is not None and shown.other_notion.neighbouring == "replacement"
    deletion = shown.with_randomized_deletion
    assert deletion is not None and deletion.neighbouring == "add-remove"
    assert deletion.eps == pytest.approx(expected.other_notion.eps + CHANNEL.eps_cr)
    assert deletion.delta == pytest.approx(expected.other_notion.delta + CHANNEL.delta_cr)
    assert shown.lower_bound is not None and shown.lower_bound.eps <= release.certificate.eps
    assert shown.local is not None
    assert (shown.local.removal, shown.local.replacement) == (4.0, 8.0)
    assert shown.crowd_check is not None
    assert (shown.crowd_check.claimed, shown.crowd_check.verified) == (VALUES.size, n)


def test_top_keeps_the_largest_estimates_largest_first(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES))
    release = layers.releases.release("homepage", 7, 7)
    top = release.to_wire(3)
    assert top.values == sorted(release.estimate.values, reverse=True)[:3]
    assert release.to_wire().bins == list(range(20))


def test_restart_keeps_accumulators_and_ledger(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver_all(make_batch(VALUES), make_batch(VALUES, shuffler="shuffler-2", seed=1))
    before = layers.releases.publish("homepage", 7, 7)
    restarted = build(database_url)
    after = restarted.releases.release("homepage", 7, 7)
    assert np.array_equal(before.estimate.values, after.estimate.values)
    assert after.estimate.n == estimated(VALUES) + estimated(VALUES, 1)
    assert [row.epoch for row in restarted.ledger.rows("homepage")] == [7]
    assert [r.epochs for r in restarted.ledger.ledger("homepage").releases] == [(7, 7)]


def test_ranges_compose_epochs_and_missing_ends_mean_the_last_epoch(database_url: str) -> None:
    layers = build(database_url)
    with pytest.raises(NothingReceivedError, match="yet"):
        layers.releases.epochs("homepage")
    layers.deliver(*make_batch(VALUES, epoch=1))
    layers.deliver(*make_batch(VALUES, epoch=2, seed=5))
    one = layers.releases.release("homepage", 1, 1).certificate
    two = layers.releases.release("homepage", 2, 2).certificate
    both = layers.releases.release("homepage", 1, 2).certificate
    assert both.eps == pytest.approx(one.eps + two.eps) and "composition" in both.note
    assert layers.releases.epochs("homepage") == (2, 2)
    assert layers.releases.epochs("homepage", epoch_from=1) == (1, 2)
    assert layers.releases.epochs("homepage", epoch=5) == (5, 5)
    with pytest.raises(NothingReceivedError, match="no batch"):
        layers.releases.release("homepage", 50, 60)
    with pytest.raises(UnknownChannelError, match="elsewhere"):
        layers.releases.release("elsewhere", 1, 1)


def test_a_channel_its_mechanism_rejects_is_refused_by_name() -> None:
    bad = CHANNEL.model_copy(update={"params": {"k": 1, "eps": 4.0}})
    with pytest.raises(InvalidChannelError, match="homepage"):
        ChannelRuntime.build(bad, ["shuffler-1"])


ABROAD = ChannelConfig(
    id="abroad",
    mechanism="longitudinal",
    params={"d": 4, "k": 1, "eps": 4.0},
    min_crowd=5,
    max_fragments=1,
    delta=1e-6,
    payload_size=16,
    display="series",
)


def test_longitudinal_release_reads_periods_from_reports_not_epoch_numbers() -> None:
    """Epochs are unix time // epoch_seconds (huge numbers); the tree period is in the report.
    A release over real epochs certifies at the smallest filled node (it used to crash)."""
    first_epoch = int(time.time() // ABROAD.epoch_seconds) - 10  # closed epochs (no future one)
    # a clock past these epochs' close timeout
    layers = build("sqlite://", [ABROAD], clock=Clock((first_epoch + 5) * 3600.0))
    params = longitudinal.LongitudinalParams(d=4, k=1, eps=4.0)
    rng = SeededSource(3)
    per_period: dict[int, list[bytes]] = {}
    for _ in range(300):
        tree = longitudinal.setup(params, rng)
        for t in range(1, 5):
            tree, report = longitudinal.update(tree, t, 1 if t == 2 else 0, params, rng)
            if report is not None:
                per_period.setdefault(t, []).append(report)
    for t, reports in per_period.items():
        batch = Batch(
            batch_id=secrets.token_hex(16),
            shuffler_id="shuffler-1",
            channel_id="abroad",
            crowd_id="",
            epoch=first_epoch + t - 1,
            n_contributions=len(reports),
            fragments=seal(reports, ABROAD, first_epoch + t - 1),
        )
        layers.deliver(*signed(batch))
    release = layers.releases.publish("abroad", first_epoch, first_epoch + 3)
    smallest = min(len(r) for r in per_period.values())
    assert release.certificate.eps < 4.0  # amplified below the local ε of one report
    assert min(release.crowds.values()) <= smallest
    assert release.estimate.n == 300
    truth = np.array([0, 300, 300, 300])  # everyone switches to state 1 at period 2
    # 4.5 standard errors: a false failure has probability < 3e-5 over the four periods.
    assert np.all(np.abs(release.estimate.values - truth) <= 4.5 * release.estimate.std_errors)
    summary = layers.store.latest_summary("abroad")
    assert summary is not None and summary.bins == [0, 1, 2, 3]  # series keep every period


def test_a_crowd_the_fragments_do_not_back_is_certified_at_the_verified_crowd(
    database_url: str,
) -> None:
    """Shuffler-2 sends 100 real reports' fragments and claims 1,000 contributions (k-RAPPOR
    may carry none, so the count alone does not refuse it): the release rests on the crowd the
    fragments can verify, says so in crowd_check and its note, and certifies the epoch at
    that crowd rather than at the claim."""
    honest_only = build("sqlite://")
    honest_only.deliver(*make_batch(VALUES, seed=1))
    honest = honest_only.releases.release("homepage", 7, 7)
    layers = build(database_url)
    inflated = make_batch(VALUES[:100], seed=2, shuffler="shuffler-2")
    boast = Batch.model_validate_json(inflated.body).model_copy(update={"n_contributions": 1000})
    layers.deliver_all(make_batch(VALUES, seed=1), signed(boast))
    assert layers.events.get("batches_short_crowd") == 2  # the honest one too: a lower bound
    release = layers.releases.release("homepage", 7, 7)
    crowds = sorted(release.crowds.values())
    verified, whole = crowds[0], crowd(VALUES, 1)
    assert crowds[1] == whole and verified == crowd(VALUES[:100], 2) <= 100  # never the claim
    assert release.estimate.n == estimated(VALUES, 1) + estimated(VALUES[:100], 2, claimed=1000)
    check = release.to_wire().crowd_check
    assert check is not None
    assert (check.batches, check.claimed, check.verified) == (2, 2000, whole + verified)
    assert (check.short_batches, check.invalid_fragments) == (2, 0)
    assert f"({whole + verified:,} of 2,000 contributions" in release.note
    # each batch is shuffled alone: the epoch is certified at its smallest (verified) batch
    expected = certify(BinaryRR(), 4.0, verified, 1e-8)
    assert release.certificate.eps == pytest.approx(expected.certified.eps)
    assert release.certificate.eps > honest.certificate.eps
    # the ledger charged the epoch at the same crowds
    (row,) = layers.ledger.rows("homepage")
    assert row.n == verified and row.certificate.eps == pytest.approx(release.certificate.eps)


def test_a_batch_its_fragments_verify_below_min_crowd_is_not_released() -> None:
    """min_crowd: "Batches below this many contributions are never released" (common.wire).
    A shuffler that sends one device's report and claims 1,000 contributions passes the
    intake's min_crowd check on its claim; the release should not rest on it."""
    layers = build("sqlite://")
    alone = make_batch(VALUES[:1], seed=2)
    boast = Batch.model_validate_json(alone.body).model_copy(update={"n_contributions": 1000})
    layers.deliver(*signed(boast))
    with pytest.raises(NothingReceivedError):
        layers.releases.release("homepage", 7, 7)
