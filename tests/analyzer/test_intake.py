"""Batch intake over both backends: verified, idempotent, chaff-tolerant, concurrent."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from analyzer.errors import (
    AnalyzerError,
    BadSignatureError,
    BatchForUnknownChannelError,
    BatchTooLargeError,
    BelowMinCrowdError,
    InconsistentCountsError,
    MalformedBatchError,
    UnknownShufflerError,
)
from analyzer.intake import Intake
from common.envelope import sign
from common.wire import Batch, b64

from .helpers import SHUFFLERS, VALUES, build, make_batch, signed


def test_a_duplicate_batch_is_acknowledged_and_counted_once(database_url: str) -> None:
    layers = build(database_url)
    body, signature = make_batch(VALUES)
    first = layers.intake.accept(body, signature)
    again = layers.intake.accept(body, signature)
    fragments = len(Batch.model_validate_json(body).fragments)
    assert first == Intake(first.batch_id, False, opened=fragments, invalid=0)
    assert again == Intake(first.batch_id, True)
    assert layers.events.get("batches_accepted") == 1
    assert layers.events.get("batches_duplicate") == 1
    assert layers.releases.release("homepage", 7, 7).estimate.n == VALUES.size


def _with(body: bytes, **changes: object) -> Batch:
    return Batch.model_validate_json(body).model_copy(update=changes)


def test_forged_unknown_and_inconsistent_batches_are_refused(database_url: str) -> None:
    accept = build(database_url).intake.accept
    body, _ = make_batch(VALUES)
    with pytest.raises(BadSignatureError, match="does not verify"):
        accept(body, b64(sign(body, Ed25519PrivateKey.generate())))
    with pytest.raises(BadSignatureError, match="header required"):
        accept(body, None)
    with pytest.raises(BadSignatureError, match="not base64"):
        accept(body, "%%%")
    stranger = _with(body, shuffler_id="shuffler-9").body()
    with pytest.raises(UnknownShufflerError, match="shuffler-9"):
        accept(stranger, b64(sign(stranger, SHUFFLERS["shuffler-1"])))
    with pytest.raises(BelowMinCrowdError, match="min_crowd=50"):
        accept(*make_batch(VALUES[:10]))
    with pytest.raises(BatchForUnknownChannelError, match="elsewhere"):
        accept(*signed(_with(body, channel_id="elsewhere")))
    with pytest.raises(InconsistentCountsError, match="cannot come from"):
        accept(*signed(_with(body, n_contributions=50)))
    with pytest.raises(MalformedBatchError) as malformed:
        accept(b"{}", base64.b64encode(b"x").decode())
    assert "batch_id: Field required" in malformed.value.detail


def test_a_batch_over_the_size_limit_is_refused_before_parsing(database_url: str) -> None:
    layers = build(database_url)
    limit = layers.intake.policy.max_batch_bytes
    with pytest.raises(BatchTooLargeError) as raised:
        layers.intake.accept(b"x" * (limit + 1), "c2ln")
    assert isinstance(raised.value, AnalyzerError) and raised.value.code == "too_large"


def test_corrupted_fragments_are_chaff_and_do_not_disturb_the_estimate(database_url: str) -> None:
    layers = build(database_url)
    layers.intake.accept(*make_batch(VALUES, seed=3))
    reference = layers.releases.release("homepage", 7, 7).estimate.values
    body, signature = make_batch(VALUES, epoch=8, seed=3, chaff=40)
    noisy = layers.intake.accept(body, signature)
    assert noisy.invalid == 40
    assert noisy.opened == len(Batch.model_validate_json(body).fragments) - 40
    assert layers.events.get("fragments_invalid") == 40
    assert np.array_equal(layers.releases.release("homepage", 8, 8).estimate.values, reference)


def test_concurrent_batches_for_one_accumulator_all_count(database_url: str) -> None:
    """Parallel intake of distinct batches into the same accumulator loses none of them."""
    layers = build(database_url)
    batches = [make_batch(VALUES[:100], seed=s) for s in range(6)]
    results: list[Intake] = []
    threads = [
        threading.Thread(target=lambda b=b: results.append(layers.intake.accept(*b)))
        for b in batches
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6 and not any(r.duplicate for r in results)
    assert layers.releases.release("homepage", 7, 7).estimate.n == 600
