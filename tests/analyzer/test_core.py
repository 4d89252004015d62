"""Analyzer core over both backends: verified idempotent intake, chaff, restart, certificates."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.channels import ChannelConfigError, ChannelRuntime
from analyzer.core import AnalyzerCore, RejectedError
from common.accounting import certify
from common.envelope import KeyRing, seal_fragment, sign
from common.mechanisms import SeededSource, krappor
from common.wire import Batch, ChannelConfig, b64
from services.runtime import db

MIGRATIONS = Path(__file__).resolve().parents[2] / "analyzer" / "migrations"
CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 20, "eps": 4.0},
    min_crowd=50,
    max_fragments=20,
    delta=1e-8,
    payload_size=16,
)
ANALYZER_KEY = X25519PrivateKey.generate()
SHUFFLERS = {"shuffler-1": Ed25519PrivateKey.generate(), "shuffler-2": Ed25519PrivateKey.generate()}


def make_core(url: str) -> AnalyzerCore:
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    runtime = ChannelRuntime.build(CHANNEL, sorted(SHUFFLERS))
    return AnalyzerCore(
        engine,
        KeyRing.of(ANALYZER_KEY),
        {"homepage": runtime},
        {k: v.public_key() for k, v in SHUFFLERS.items()},
    )


def make_batch(
    values: np.ndarray, epoch: int = 7, shuffler: str = "shuffler-1", seed: int = 0, chaff: int = 0
) -> tuple[bytes, str]:
    params = krappor.KRapporParams(k=20, eps=4.0)
    rng = SeededSource(seed)
    fragments = [
        seal_fragment(f, "homepage", 16, ANALYZER_KEY.public_key())
        for v in values
        for f in krappor.encode(int(v), params, rng)
    ]
    fragments += [secrets.token_bytes(len(fragments[0])) for _ in range(chaff)]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id="homepage",
        crowd_id="",
        epoch=epoch,
        n_contributions=len(values),
        fragments=[b64(f) for f in fragments],
    )
    body = batch.body()
    return body, b64(sign(body, SHUFFLERS[shuffler]))


VALUES = np.repeat(np.arange(5), [400, 300, 200, 80, 20])


def test_duplicate_batches_count_once_and_estimates_cover_the_truth(database_url: str) -> None:
    core = make_core(database_url)
    body, signature = make_batch(VALUES)
    first = core.accept(body, signature)
    again = core.accept(body, signature)
    assert not first.duplicate and again.duplicate and first.invalid == 0
    release = core.release("homepage", 7, 7)
    assert release.estimate.n == VALUES.size
    truth = np.bincount(VALUES, minlength=20)
    lo, hi = release.estimate.interval()
    inside = np.mean((lo <= truth) & (truth <= hi))
    assert inside >= 0.85
    expected = certify("krappor", 4.0, VALUES.size, 1e-8)
    assert release.certificate.eps == pytest.approx(expected.certified.eps)
    assert release.certificate.method == expected.certified.method
    shown = release.as_dict()
    assert shown["other_notion"]["neighbouring"] == "replacement"
    deletion = shown["with_randomized_deletion"]
    assert deletion["neighbouring"] == "add-remove"
    assert deletion["eps"] == pytest.approx(expected.other_notion.eps + CHANNEL.eps_cr)
    assert deletion["delta"] == pytest.approx(expected.other_notion.delta + CHANNEL.delta_cr)
    assert shown["lower_bound"]["eps"] <= release.certificate.eps
    assert shown["local"]["removal"] == 4.0 and shown["local"]["replacement"] == 8.0


def test_forged_unknown_and_inconsistent_batches_are_refused(database_url: str) -> None:
    core = make_core(database_url)
    body, _ = make_batch(VALUES)
    forged = b64(sign(body, Ed25519PrivateKey.generate()))
    with pytest.raises(RejectedError) as raised:
        core.accept(body, forged)
    assert raised.value.status == 401 and raised.value.error == "bad_signature"
    stranger = (
        Batch.model_validate_json(body).model_copy(update={"shuffler_id": "shuffler-9"}).body()
    )
    with pytest.raises(RejectedError) as raised:
        core.accept(stranger, b64(sign(stranger, SHUFFLERS["shuffler-1"])))
    assert raised.value.status == 401 and raised.value.error == "unknown_shuffler"
    small_body, small_signature = make_batch(VALUES[:10])
    with pytest.raises(RejectedError) as raised:
        core.accept(small_body, small_signature)
    assert raised.value.status == 422 and raised.value.error == "below_min_crowd"
    with pytest.raises(RejectedError) as raised:
        core.accept(b"{}", base64.b64encode(b"x").decode())
    assert raised.value.status == 400


def test_corrupted_fragments_are_chaff_and_do_not_disturb_the_estimate(database_url: str) -> None:
    clean, noisy = make_core(database_url), None
    body, signature = make_batch(VALUES, seed=3)
    clean.accept(body, signature)
    reference = clean.release("homepage", 7, 7).estimate.values
    noisy_body, noisy_signature = make_batch(VALUES, epoch=8, seed=3, chaff=40)
    noisy = clean.accept(noisy_body, noisy_signature)
    assert noisy.invalid == 40
    assert np.array_equal(clean.release("homepage", 8, 8).estimate.values, reference)


def test_restart_keeps_accumulators_and_ledger(database_url: str) -> None:
    core = make_core(database_url)
    core.accept(*make_batch(VALUES))
    core.accept(*make_batch(VALUES, shuffler="shuffler-2", seed=1))
    before = core.release("homepage", 7, 7)
    restarted = make_core(database_url)
    after = restarted.release("homepage", 7, 7)
    assert np.array_equal(before.estimate.values, after.estimate.values)
    assert after.estimate.n == 2 * VALUES.size
    from sqlalchemy import func, select

    from analyzer import storage

    with restarted.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(storage.releases)).scalar_one() == 2


def test_ranges_compose_epochs_and_bad_channels_are_refused(database_url: str) -> None:
    core = make_core(database_url)
    core.accept(*make_batch(VALUES, epoch=1))
    core.accept(*make_batch(VALUES, epoch=2, seed=5))
    one = core.release("homepage", 1, 1).certificate
    both = core.release("homepage", 1, 2).certificate
    assert both.eps == pytest.approx(2 * one.eps) and "composition" in both.note
    with pytest.raises(RejectedError, match="no batch"):
        core.release("homepage", 50, 60)
    bad = CHANNEL.model_copy(update={"params": {"k": 1, "eps": 4.0}})
    with pytest.raises(ChannelConfigError, match="homepage"):
        ChannelRuntime.build(bad, ["shuffler-1"])


def test_concurrent_batches_for_one_accumulator_all_count(database_url: str) -> None:
    """Parallel intake of distinct batches into the same accumulator loses none of them."""
    import threading

    core = make_core(database_url)
    batches = [make_batch(VALUES[:100], seed=s) for s in range(6)]
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda b=b: results.append(core.accept(*b))) for b in batches
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6 and not any(r.duplicate for r in results)  # type: ignore[attr-defined]
    assert core.release("homepage", 7, 7).estimate.n == 600


def test_longitudinal_release_reads_periods_from_reports_not_epoch_numbers() -> None:
    """Epochs are unix time // epoch_seconds (huge numbers); the tree period is in the report.
    A release over real epochs certifies at the smallest filled node (it used to crash)."""
    from common.mechanisms import longitudinal

    config = ChannelConfig(
        id="abroad",
        mechanism="longitudinal",
        params={"d": 4, "k": 1, "eps": 4.0},
        min_crowd=5,
        max_fragments=1,
        delta=1e-6,
        payload_size=16,
        display="series",
    )
    params = longitudinal.LongitudinalParams(d=4, k=1, eps=4.0)
    engine = db.make_engine("sqlite://")
    db.upgrade(engine, MIGRATIONS)
    core = AnalyzerCore(
        engine,
        KeyRing.of(ANALYZER_KEY),
        {"abroad": ChannelRuntime.build(config, sorted(SHUFFLERS))},
        {k: v.public_key() for k, v in SHUFFLERS.items()},
    )
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
        body = batch.body()
        core.accept(body, b64(sign(body, SHUFFLERS["shuffler-1"])))
    release = core.release("abroad", first_epoch, first_epoch + 3)
    smallest = min(len(r) for r in per_period.values())
    assert release.certificate.eps < 4.0  # amplified below the local ε of one report
    assert min(release.crowds.values()) <= smallest
    assert release.estimate.n == 300
    truth = np.array([0, 300, 300, 300])  # everyone switches to state 1 at period 2
    # 4.5 standard errors: a false failure has probability < 3e-5 over the four periods.
    assert np.all(np.abs(release.estimate.values - truth) <= 4.5 * release.estimate.std_errors)
