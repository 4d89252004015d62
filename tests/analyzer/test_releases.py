"""Releases over both backends: estimates cover the truth, certificates match the accountant,
ranges compose, restarts keep everything, longitudinal channels certify by period."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from analyzer.channels import ChannelRuntime
from analyzer.errors import InvalidChannelError, NothingReceivedError, UnknownChannelError
from common.accounting import certify
from common.envelope import seal_fragment
from common.mechanisms import longitudinal
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, b64

from .helpers import ANALYZER_KEY, CHANNEL, VALUES, build, make_batch, signed


def test_estimates_cover_the_truth_and_certificates_match_the_accountant(
    database_url: str,
) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES))
    release = layers.releases.release("homepage", 7, 7)
    assert release.estimate.n == VALUES.size
    truth = np.bincount(VALUES, minlength=20)
    lo, hi = release.estimate.interval()
    assert np.mean((lo <= truth) & (truth <= hi)) >= 0.85
    expected = certify("krappor", 4.0, VALUES.size, 1e-8)
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


def test_top_keeps_the_largest_estimates_largest_first(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES))
    release = layers.releases.release("homepage", 7, 7)
    top = release.to_wire(3)
    assert top.values == sorted(release.estimate.values, reverse=True)[:3]
    assert release.to_wire().bins == list(range(20))


def test_restart_keeps_accumulators_and_ledger(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES))
    layers.deliver(*make_batch(VALUES, shuffler="shuffler-2", seed=1))
    before = layers.releases.publish("homepage", 7, 7)
    restarted = build(database_url)
    after = restarted.releases.release("homepage", 7, 7)
    assert np.array_equal(before.estimate.values, after.estimate.values)
    assert after.estimate.n == 2 * VALUES.size
    assert [row.epoch for row in restarted.ledger.rows("homepage")] == [7]
    assert [r.epochs for r in restarted.ledger.ledger("homepage").releases] == [(7, 7)]


def test_ranges_compose_epochs_and_missing_ends_mean_the_last_epoch(database_url: str) -> None:
    layers = build(database_url)
    with pytest.raises(NothingReceivedError, match="yet"):
        layers.releases.epochs("homepage")
    layers.deliver(*make_batch(VALUES, epoch=1))
    layers.deliver(*make_batch(VALUES, epoch=2, seed=5))
    one = layers.releases.release("homepage", 1, 1).certificate
    both = layers.releases.release("homepage", 1, 2).certificate
    assert both.eps == pytest.approx(2 * one.eps) and "composition" in both.note
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
    layers = build("sqlite://", [ABROAD])
    params = longitudinal.LongitudinalParams(d=4, k=1, eps=4.0)
    rng = SeededSource(3)
    first_epoch = 359_066_401
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
            fragments=[
                b64(seal_fragment(r, "abroad", 16, ANALYZER_KEY.public_key())) for r in reports
            ],
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
