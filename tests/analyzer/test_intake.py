"""Batch part intake over both backends (issue 11): verified, stored, idempotent per
(batch_id, part), opened once in the background, counted only when complete."""

from __future__ import annotations

import base64
import json
import math
import secrets
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from analyzer.channels import ChannelRuntime
from analyzer.errors import (
    AnalyzerError,
    BadSignatureError,
    BatchForUnknownChannelError,
    BatchTooLargeError,
    BelowMinCrowdError,
    DuplicateGroupError,
    EpochsOpenError,
    FutureEpochError,
    IncompleteBatchesError,
    InconsistentCountsError,
    InvalidChannelError,
    MalformedBatchError,
    UnknownCrowdError,
    UnknownShufflerError,
)
from analyzer.intake import MAX_STORED_INT, PartIntake, _header, signature_bytes
from analyzer.store import StoredBatch, batch_parts, receipts
from common.envelope import sign
from common.mechanisms import krr
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, b64

from .helpers import (
    CHANNEL,
    SHUFFLERS,
    VALUES,
    Clock,
    Signed,
    build,
    crowd,
    estimated,
    make_batch,
    seal,
    signed,
)


def _parts(body: bytes, parts: int) -> list[Signed]:
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
    body, signature, shuffler = make_batch(VALUES)
    first = layers.intake.accept(body, signature, shuffler)
    again = layers.intake.accept(body, signature, shuffler)
    assert first == PartIntake(first.batch_id, 0, False)
    assert again == PartIntake(first.batch_id, 0, True)
    assert [p.batch_id for p in layers.store.pending_parts()] == [first.batch_id]
    assert layers.opener.open_pending() == 1 and layers.opener.open_pending() == 0
    assert layers.deliver(body, signature, shuffler).duplicate
    assert layers.events.get("parts_stored") == 1
    assert layers.events.get("batches_duplicate") == 2
    assert layers.releases.release("homepage", 7, 7).estimate.n == estimated(VALUES)


def test_a_batch_counts_only_when_all_its_parts_are_opened(database_url: str) -> None:
    """Parts of shuffler-1's batch arrive during epoch 7 (its close a minute after its end):
    the epoch settles when the last part completes the third shuffler's batch, and never
    shows the other shufflers' batches alone meanwhile."""
    clock = Clock(7 * 3600 + 10)
    layers = build(database_url, clock=clock, close_seconds=60)
    whole = make_batch(VALUES, seed=4)
    parts = _parts(whole.body, 3)
    for part in parts[:2]:
        layers.deliver(*part)
    with pytest.raises(IncompleteBatchesError, match="parts missing or unopened"):
        layers.releases.release("homepage", 7, 7)
    assert layers.store.charges("homepage") == []
    others = [
        make_batch(VALUES, seed=5, shuffler="shuffler-2"),
        make_batch(VALUES, seed=6, shuffler="shuffler-3"),
    ]
    layers.deliver_all(*others)
    with pytest.raises(EpochsOpenError, match="epoch 7: 2"):
        layers.releases.release("homepage", 7, 7)
    layers.deliver(*parts[2])
    for part in parts:
        assert layers.deliver(*part).duplicate
    complete = layers.releases.release("homepage", 7, 7)
    both = sum(estimated(VALUES, seed) for seed in (4, 5, 6))
    assert complete.estimate.n == both and "incomplete" not in complete.to_wire().note
    reference = build(database_url.replace("test.db", "ref.db"))
    if "sqlite" in database_url:
        reference.deliver_all(whole, *others)
        expected = reference.releases.release("homepage", 7, 7)
        assert np.array_equal(complete.estimate.values, expected.estimate.values)
        assert complete.certificate == expected.certificate
    charge = layers.store.charges("homepage")
    assert [(c.epoch, c.batches) for c in charge] == [(7, 3)]


def test_parts_that_disagree_with_their_batch_are_refused(database_url: str) -> None:
    layers = build(database_url)
    body = make_batch(VALUES).body
    first, second = _parts(body, 2)
    layers.intake.accept(*first)
    other = Batch.model_validate_json(second.body).model_copy(update={"n_contributions": 999})
    with pytest.raises(InconsistentCountsError, match="disagrees"):
        layers.intake.accept(*signed(other))
    greedy = Batch.model_validate_json(second.body)
    greedy = greedy.model_copy(update={"fragments": greedy.fragments * 40})
    with pytest.raises(InconsistentCountsError, match="cannot come from"):
        layers.intake.accept(*signed(greedy))


def _with(body: bytes, **changes: object) -> Batch:
    return Batch.model_validate_json(body).model_copy(update=changes)


def test_forged_unknown_and_inconsistent_batches_are_refused(database_url: str) -> None:
    accept = build(database_url).intake.accept
    body, signature, _ = make_batch(VALUES)
    with pytest.raises(BadSignatureError, match="does not verify"):
        accept(body, b64(sign(body, Ed25519PrivateKey.generate())), "shuffler-1")
    with pytest.raises(BadSignatureError, match="header required"):
        accept(body, None, "shuffler-1")
    with pytest.raises(BadSignatureError, match="not base64"):
        accept(body, "%%%", "shuffler-1")
    # the sender is the ESA-Shuffler header, checked before anything else
    for sender in (None, ""):
        with pytest.raises(UnknownShufflerError, match="ESA-Shuffler header required"):
            accept(body, signature, sender)
    with pytest.raises(UnknownShufflerError, match="shuffler-9"):
        accept(body, signature, "shuffler-9")
    # shuffler-2 cannot pass its part off as shuffler-1's, nor sign one naming shuffler-1
    with pytest.raises(BadSignatureError, match="does not verify"):
        accept(body, b64(sign(body, SHUFFLERS["shuffler-2"])), "shuffler-1")
    with pytest.raises(MalformedBatchError, match="must name the shuffler that signs it"):
        accept(*signed(_with(body), "shuffler-2"))
    stranger = _with(body, shuffler_id="shuffler-9").body()
    with pytest.raises(MalformedBatchError, match="must name the shuffler that signs it"):
        accept(stranger, b64(sign(stranger, SHUFFLERS["shuffler-1"])), "shuffler-1")
    with pytest.raises(BelowMinCrowdError, match="min_crowd=50"):
        accept(*make_batch(VALUES[:10]))
    with pytest.raises(BatchForUnknownChannelError, match="elsewhere"):
        accept(*signed(_with(body, channel_id="elsewhere")))
    with pytest.raises(InconsistentCountsError, match="cannot come from"):
        accept(*signed(_with(body, n_contributions=50)))
    with pytest.raises(MalformedBatchError) as malformed:
        accept(b"{}", b64(sign(b"{}", SHUFFLERS["shuffler-1"])), "shuffler-1")
    assert "shuffler_id: Field required" in malformed.value.detail
    with pytest.raises(MalformedBatchError) as malformed:
        accept(*signed_json({"shuffler_id": "shuffler-1"}))
    assert "batch_id: Field required" in malformed.value.detail


def signed_json(document: object, shuffler: str = "shuffler-1") -> Signed:
    """Any JSON document, signed by a registered shuffler and sent as it."""
    body = json.dumps(document).encode()
    return Signed(body, b64(sign(body, SHUFFLERS[shuffler])), shuffler)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (None, "header required"),
        ("", "header required"),
        ("%%%", "not base64"),
        (base64.b64encode(b"x").decode(), "64-byte"),
        (base64.b64encode(bytes(65)).decode(), "got 65 bytes"),
        (base64.b64encode(bytes(64)).decode() + "\xff", "not base64"),
    ],
)
def test_an_ill_formed_signature_header_is_refused_before_the_body_is_looked_at(
    header: str | None, problem: str
) -> None:
    with pytest.raises(BadSignatureError, match=problem):
        signature_bytes(header)
    assert signature_bytes(base64.b64encode(bytes(64)).decode()) == bytes(64)


def test_the_signature_is_checked_before_the_batch_is_validated(database_url: str) -> None:
    """An unsigned body that is not a batch is a 401, not a 400 (nothing but ``shuffler_id``
    is read before the signature verifies); once signed, the same body is malformed."""
    accept = build(database_url).intake.accept
    forged = {"shuffler_id": "shuffler-1", "part": 3, "parts": 1}
    body = signed_json(forged).body
    with pytest.raises(BadSignatureError, match="does not verify"):
        accept(body, b64(sign(body, Ed25519PrivateKey.generate())), "shuffler-1")
    with pytest.raises(BadSignatureError, match="does not verify"):  # not even parsed
        accept(b"\xff\xfe{", base64.b64encode(bytes(64)).decode(), "shuffler-1")
    with pytest.raises(MalformedBatchError, match="batch_id"):
        accept(*signed_json(forged))
    with pytest.raises(MalformedBatchError, match="not a batch"):
        accept(b"\xff\xfe{", b64(sign(b"\xff\xfe{", SHUFFLERS["shuffler-1"])), "shuffler-1")


@pytest.mark.parametrize(
    "changes",
    [{"n_contributions": MAX_STORED_INT + 1}, {"parts": MAX_STORED_INT + 1, "part": 0}],
    ids=["n_contributions", "parts"],
)
def test_numbers_the_tables_cannot_hold_are_malformed_on_both_databases(
    database_url: str, changes: dict[str, int]
) -> None:
    """Above 2^31 - 1 (the ``Integer`` columns) a signed part is a 400 on SQLite as on
    PostgreSQL, never a storage error; at the bound it is stored."""
    layers = build(database_url)
    body = make_batch(VALUES[:100]).body
    with pytest.raises(MalformedBatchError, match=f"<= {MAX_STORED_INT}"):
        layers.intake.accept(*signed(_with(body, **changes)))
    at_bound = {k: v - 1 for k, v in changes.items() if k != "part"}
    assert not layers.intake.accept(*signed(_with(body, **at_bound))).duplicate
    assert layers.store.pending_parts()[0].n_contributions in (100, MAX_STORED_INT)


def test_only_declared_crowds_are_accepted(database_url: str) -> None:
    """Crowds come from the signed channel config, never from what the batch names."""
    crowded = CHANNEL.model_copy(update={"crowds": ("", "eu")})
    accept = build(database_url, [crowded]).intake.accept
    body = make_batch(VALUES[:100]).body
    with pytest.raises(UnknownCrowdError, match="not declared"):
        accept(*signed(_with(body, crowd_id="us")))
    with pytest.raises(MalformedBatchError, match="crowd_id"):
        accept(*signed(_with(body, crowd_id="x" * 10_000)))
    assert not accept(*signed(_with(body, crowd_id="eu"))).duplicate


def test_a_batch_over_the_size_limit_is_refused_before_parsing(database_url: str) -> None:
    layers = build(database_url)
    limit = layers.intake.policy.max_batch_bytes
    with pytest.raises(BatchTooLargeError) as raised:
        layers.intake.accept(b"x" * (limit + 1), "c2ln", "shuffler-1")
    assert isinstance(raised.value, AnalyzerError) and raised.value.code == "too_large"


def test_the_receipt_counts_the_chaff_the_metrics_count(database_url: str) -> None:
    """Issue 12: a receipt stored ``invalid = 0`` while the answer and the metrics counted the
    fragments that failed to open. Chaff is known only once a part is opened, so the receipt
    is written then (when the batch's last part is folded in) with every part's chaff, and
    ``esa_analyzer_fragments_invalid`` counts the same fragments."""
    layers = build(database_url)
    whole = make_batch(VALUES, seed=6, chaff=45).body
    shuffled = Batch.model_validate_json(whole)
    real, chaff = shuffled.fragments[:-45], shuffled.fragments[-45:]
    step = len(real) // len(chaff)  # one chaff after every ``step`` real: in every part
    spread = [f for i, c in enumerate(chaff) for f in (*real[i * step : (i + 1) * step], c)]
    mixed = shuffled.model_copy(update={"fragments": spread + real[len(chaff) * step :]})
    parts = _parts(mixed.body(), 3)
    for part in parts:
        layers.deliver(*part)
    with layers.store.engine.connect() as conn:
        receipt = conn.execute(
            select(receipts.c.invalid, receipts.c.n_fragments, receipts.c.n_verified)
        ).one()
        per_part = conn.execute(select(batch_parts.c.invalid)).scalars().all()
    assert receipt.invalid == 45 == layers.events.get("fragments_invalid")
    assert sum(per_part) == 45 and sum(1 for n in per_part if n) >= 2
    assert receipt.n_fragments == len(mixed.fragments)
    # garbage fills at most one contribution per max_fragments of it (a client's whole report),
    # and never lifts the crowd the valid fragments prove
    lost = math.ceil(45 / CHANNEL.max_fragments)
    assert (
        receipt.n_verified
        == crowd(VALUES, 6, invalid=45)
        == min(VALUES.size - lost, crowd(VALUES, 6))
    )


def test_corrupted_fragments_are_chaff_and_cost_the_crowd_what_they_can_fill(
    database_url: str,
) -> None:
    """Fragments that do not open are counted and left out of the statistics; the batch is
    certified and estimated on its claimed crowd less the contributions they can have filled
    (one per max_fragments of them)."""
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES, seed=3))
    clean = layers.releases.release("homepage", 7, 7)
    layers.deliver(*make_batch(VALUES, epoch=8, seed=3, chaff=40))
    assert layers.events.get("fragments_invalid") == 40
    assert layers.events.get("batches_short_crowd") == 2  # both below their claim
    verified = crowd(VALUES, 3, invalid=40)
    assert verified == min(VALUES.size - math.ceil(40 / CHANNEL.max_fragments), crowd(VALUES, 3))
    chaffed = layers.releases.release("homepage", 8, 8)
    assert verified <= chaffed.estimate.n == estimated(VALUES, 3, invalid=40)
    check = chaffed.to_wire().crowd_check
    assert check is not None
    assert (check.batches, check.claimed, check.verified) == (1, VALUES.size, verified)
    assert (check.invalid_fragments, check.short_batches) == (40, 1)
    assert "1 batch(es) certified at the crowd their fragments verify" in chaffed.note
    # chaff never raises the crowd: at most the clean batch's, so at least its epsilon
    assert chaffed.estimate.n <= clean.estimate.n == estimated(VALUES, 3)
    assert chaffed.certificate.eps >= clean.certificate.eps


def test_concurrent_parts_for_one_accumulator_all_count(database_url: str) -> None:
    """Parallel intake of distinct batches into the same accumulator loses none of them
    (one per epoch: a group sends one batch)."""
    layers = build(database_url)
    batches = [make_batch(VALUES[:100], epoch=7 + s, seed=s) for s in range(6)]
    results: list[PartIntake] = []
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
    layers.closer.close_due()
    assert layers.releases.release("homepage", 7, 12).estimate.n == sum(
        estimated(VALUES[:100], s) for s in range(6)
    )


def test_a_group_sends_one_batch(database_url: str) -> None:
    """A second batch (another batch_id) for the same (shuffler, channel, crowd, epoch) could
    only count its users twice: refused as duplicate_group, whatever its content. Another
    shuffler, epoch or crowd is another group; the first batch's own parts still go in."""
    crowded = CHANNEL.model_copy(update={"crowds": ("", "eu")})
    clock = Clock(7 * 3600 + 10)
    layers = build(database_url, [crowded], clock=clock, close_seconds=3600)
    first = make_batch(VALUES, seed=1)
    head, tail = _parts(first.body, 2)
    layers.deliver(*head)
    with pytest.raises(DuplicateGroupError, match="already sent batch") as refused:
        layers.intake.accept(*make_batch(VALUES, seed=2))
    assert refused.value.code == "duplicate_group"
    assert Batch.model_validate_json(head.body).batch_id in refused.value.detail
    layers.deliver(*tail)
    assert layers.deliver(*head).duplicate  # the same part again: acknowledged, counted once
    with pytest.raises(DuplicateGroupError):
        layers.intake.accept(*make_batch(VALUES[:100], seed=3))
    for other in (
        make_batch(VALUES, seed=4, shuffler="shuffler-2"),
        make_batch(VALUES, seed=5, epoch=8),
        make_batch(VALUES, seed=6, crowd="eu"),
    ):
        assert not layers.deliver(*other).duplicate
    layers.deliver(*make_batch(VALUES, seed=7, shuffler="shuffler-3"))
    assert layers.releases.release("homepage", 7, 7).estimate.n == sum(
        estimated(VALUES, s) for s in (1, 4, 7)
    )
    clock.now = 9 * 3600  # ``eu`` of epoch 7 closes, shufflers 2 and 3 sent none
    layers.closer.close_due()
    assert layers.releases.release("homepage", 7, 7, crowd_id="eu").estimate.n == estimated(
        VALUES, 6
    )


def test_two_workers_never_take_two_batches_for_one_group(postgres_url: str) -> None:
    """Two analyzer workers on one database store the first parts of two batches of one group
    at once: the second waits for the first's transaction and is refused as duplicate_group
    (otherwise both would complete, and a batch finishing after its epoch settled could change
    a release by itself)."""
    one, two = build(postgres_url), build(postgres_url)
    first, second = make_batch(VALUES, seed=1), make_batch(VALUES, seed=2)
    entered, release = threading.Event(), threading.Event()

    def held(stored: StoredBatch) -> None:  # the first worker, inside its transaction
        entered.set()
        release.wait(30)

    header = _header(Batch.model_validate_json(first.body))
    storing = threading.Thread(target=one.store.store_part, args=(header, first.body, held))
    storing.start()
    assert entered.wait(30)
    outcome: list[object] = []

    def rival() -> None:
        try:
            outcome.append(two.intake.accept(*second))
        except DuplicateGroupError as refused:
            outcome.append(refused)

    racing = threading.Thread(target=rival)
    racing.start()
    time.sleep(1.0)  # the rival runs now: it must wait for the first transaction
    release.set()
    storing.join(30)
    racing.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], DuplicateGroupError), outcome


REGIONAL = ChannelConfig(
    id="regional",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    min_crowd=50,
    max_fragments=1,
    min_fragments=1,
    payload_size=16,
)


def _krr_batch(
    n: int, fragments: int, parts: int = 1, part: int = 0, batch_id: str = "", epoch: int = 7
) -> Signed:
    """A part of a k-RR batch claiming ``n`` contributions with ``fragments`` real reports."""
    rng = SeededSource(n * 7 + fragments)
    params = krr.KRRParams(k=4, eps=2.0)
    opened = [f for i in range(fragments) for f in krr.KRR().encode_value(params, i % 4, rng)]
    batch = Batch(
        batch_id=batch_id or secrets.token_hex(16),
        part=part,
        parts=parts,
        shuffler_id="shuffler-1",
        channel_id=REGIONAL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=n,
        fragments=seal(opened, REGIONAL, epoch),
    )
    return signed(batch)


def test_a_fixed_count_channel_takes_exactly_n_fragments(database_url: str) -> None:
    """k-RR sends one report per contribution, and this channel pins min_fragments =
    max_fragments = 1 (shufflers enforce both): a batch whose fragments are not exactly its
    n_contributions can only come from a lying shuffler (422 inconsistent_counts)."""
    layers = build(database_url, [REGIONAL])
    with pytest.raises(InconsistentCountsError, match="at most 1") as refused:
        layers.intake.accept(*_krr_batch(99, 100))
    assert refused.value.code == "inconsistent_counts"
    with pytest.raises(InconsistentCountsError, match="exactly 1 fragments each"):
        layers.intake.accept(*_krr_batch(101, 100))
    # with parts, the shortfall is known once the last part is in
    batch_id = secrets.token_hex(16)
    layers.intake.accept(*_krr_batch(150, 100, parts=2, part=0, batch_id=batch_id))
    with pytest.raises(InconsistentCountsError, match="140 fragments cannot come from 150"):
        layers.intake.accept(*_krr_batch(150, 40, parts=2, part=1, batch_id=batch_id))
    assert layers.store.pending_parts()[0].batch_id == batch_id  # the first part stays stored
    # exactly n (in another epoch: epoch 7's group has its batch): accepted, crowd as claimed
    assert not layers.deliver(*_krr_batch(100, 100, epoch=8)).duplicate
    release = layers.releases.release("regional", 8, 8)
    assert release.estimate.n == 100 and release.crowd_check is not None
    assert release.crowd_check.verified == release.crowd_check.claimed == 100


def test_a_channel_whose_min_fragments_honest_reports_miss_is_refused() -> None:
    """k-RAPPOR may send no fragment at all (every bit off): a channel requiring one would
    make shufflers refuse honest reports."""
    with pytest.raises(InvalidChannelError, match="min_fragments=1"):
        ChannelRuntime.build(CHANNEL.model_copy(update={"min_fragments": 1}), sorted(SHUFFLERS))
    assert ChannelRuntime.build(REGIONAL, sorted(SHUFFLERS)).config.min_fragments == 1
    with pytest.raises(ValueError, match="above max_fragments"):
        ChannelConfig.model_validate({**REGIONAL.model_dump(), "min_fragments": 2})


def test_a_batch_for_an_epoch_beyond_the_clock_skew_is_refused(database_url: str) -> None:
    """A shuffler sends a group's batch once its epoch closed: an epoch that starts more than
    ``epoch_skew_seconds`` (300 s) after the analyzer's clock is refused and nothing stored;
    one that starts within the skew (a shuffler's clock 200 s ahead) is taken."""
    layers = build(database_url)
    period = CHANNEL.epoch_seconds
    now = 8 * period - 200.0  # the analyzer is in epoch 7, 200 s before epoch 8 starts
    layers.intake.policy = replace(layers.intake.policy, clock=lambda: now)
    far = 8 + 10**6 * 3600 // period  # 10^6 hours ahead
    for epoch in (9, far):
        with pytest.raises(FutureEpochError, match=f"epoch {epoch} of channel 'homepage'"):
            layers.intake.accept(*make_batch(VALUES, epoch=epoch))
    with layers.store.engine.connect() as conn:
        assert conn.execute(select(batch_parts.c.epoch)).all() == []
    assert not layers.intake.accept(*make_batch(VALUES, epoch=8)).duplicate
