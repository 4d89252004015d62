"""Batch part intake over both backends (issue 11): verified, stored, idempotent per
(batch_id, part), opened once in the background, counted only when complete."""

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
    IncompleteBatchesError,
    InconsistentCountsError,
    MalformedBatchError,
    UnknownShufflerError,
)
from analyzer.intake import Intake
from common.envelope import sign
from common.wire import Batch, b64

from .helpers import SHUFFLERS, VALUES, build, make_batch, signed


def _parts(body: bytes, parts: int) -> list[tuple[bytes, str]]:
    """The batch cut into ``parts`` signed parts (the whole group's n in each)."""
    batch = Batch.model_validate_json(body)
    step = -(-len(batch.fragments) // parts)
    return [
        signed(
            batch.model_copy(
                update={
                    "part": i,
                    "parts": parts,
                    "fragments": batch.fragments[i * step : (i + 1) * step],
                }
            )
        )
        for i in range(parts)
    ]


def test_a_part_is_stored_and_acknowledged_before_it_is_opened(database_url: str) -> None:
    layers = build(database_url)
    body, signature = make_batch(VALUES)
    first = layers.intake.accept(body, signature)
    again = layers.intake.accept(body, signature)
    assert first == Intake(first.batch_id, 0, False)
    assert again == Intake(first.batch_id, 0, True)
    assert [p.batch_id for p in layers.store.pending_parts()] == [first.batch_id]
    assert layers.opener.open_pending() == 1 and layers.opener.open_pending() == 0
    assert layers.deliver(body, signature).duplicate
    assert layers.events.get("parts_stored") == 1
    assert layers.events.get("batches_duplicate") == 2
    assert layers.releases.release("homepage", 7, 7).estimate.n == VALUES.size


def test_a_batch_counts_only_when_all_its_parts_are_opened(database_url: str) -> None:
    layers = build(database_url)
    whole = make_batch(VALUES, seed=4)
    parts = _parts(whole[0], 3)
    for part in parts[:2]:
        layers.deliver(*part)
    with pytest.raises(IncompleteBatchesError, match="parts missing or unopened"):
        layers.releases.release("homepage", 7, 7)
    assert layers.store.charges("homepage") == []
    layers.deliver(*make_batch(VALUES, seed=5, shuffler="shuffler-2"))
    partial = layers.releases.release("homepage", 7, 7)
    assert partial.estimate.n == VALUES.size and "2/3 parts" in partial.to_wire().note
    layers.deliver(*parts[2])
    for part in parts:
        assert layers.deliver(*part).duplicate
    complete = layers.releases.release("homepage", 7, 7)
    assert complete.estimate.n == 2 * VALUES.size and "incomplete" not in complete.to_wire().note
    reference = build(database_url.replace("test.db", "ref.db"))
    if "sqlite" in database_url:
        reference.deliver(*whole)
        reference.deliver(*make_batch(VALUES, seed=5, shuffler="shuffler-2"))
        expected = reference.releases.release("homepage", 7, 7)
        assert np.array_equal(complete.estimate.values, expected.estimate.values)
        assert complete.certificate == expected.certificate
    charge = layers.store.charges("homepage")
    assert [(c.epoch, c.batches) for c in charge] == [(7, 2)]


def test_parts_that_disagree_with_their_batch_are_refused(database_url: str) -> None:
    layers = build(database_url)
    body, _ = make_batch(VALUES)
    first, second = _parts(body, 2)
    layers.intake.accept(*first)
    other = Batch.model_validate_json(second[0]).model_copy(update={"n_contributions": 999})
    with pytest.raises(InconsistentCountsError, match="disagrees"):
        layers.intake.accept(*signed(other))
    greedy = Batch.model_validate_json(second[0])
    greedy = greedy.model_copy(update={"fragments": greedy.fragments * 40})
    with pytest.raises(InconsistentCountsError, match="cannot come from"):
        layers.intake.accept(*signed(greedy))


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
    layers.deliver(*make_batch(VALUES, seed=3))
    reference = layers.releases.release("homepage", 7, 7).estimate.values
    layers.deliver(*make_batch(VALUES, epoch=8, seed=3, chaff=40))
    assert layers.events.get("fragments_invalid") == 40
    assert np.array_equal(layers.releases.release("homepage", 8, 8).estimate.values, reference)


def test_concurrent_parts_for_one_accumulator_all_count(database_url: str) -> None:
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
    assert layers.opener.open_pending() == 6
    assert layers.releases.release("homepage", 7, 7).estimate.n == 600
