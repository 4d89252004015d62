"""A sealed fragment counts once per channel epoch: repeated within a part, across the parts of
a batch, across batches of two shufflers, or folded by two analyzer workers sharing one
database, the first copy counts and every later one is invalid (``fragments_repeated``).
Real HPKE, real databases (SQLite and PostgreSQL), the analyzer's own layers."""

from __future__ import annotations

import secrets
import threading

from sqlalchemy import func, select

from analyzer.opening import PartFold
from analyzer.seen import RECORD_KEY_SIZE, seen_parts
from analyzer.store import PartHeader
from common.wire import Batch

from .helpers import CHANNEL, VALUES, Layers, Signed, build, reports, seal, signed

HONEST = VALUES[::2]  # 500 contributions


def _batch(
    fragments: list[str],
    n: int,
    *,
    epoch: int = 7,
    shuffler: str = "shuffler-1",
    parts: int = 1,
    part: int = 0,
    batch_id: str | None = None,
) -> Signed:
    return signed(
        Batch(
            batch_id=batch_id or secrets.token_hex(16),
            part=part,
            parts=parts,
            shuffler_id=shuffler,
            channel_id=CHANNEL.id,
            crowd_id="",
            epoch=epoch,
            n_contributions=n,
            fragments=fragments,
        )
    )


def _verified(layers: Layers, epoch: int) -> tuple[int, int]:
    delivered = layers.store.delivered(CHANNEL.id, "", epoch, epoch)
    return sum(b.verified for b in delivered), sum(b.invalid for b in delivered)


def _seen(layers: Layers) -> int:
    with layers.store.engine.connect() as conn:
        size = select(func.coalesce(func.sum(func.length(seen_parts.c["keys"])), 0))
        return int(conn.execute(size).scalar_one()) // RECORD_KEY_SIZE


def test_a_part_that_repeats_its_fragments_counts_each_once(database_url: str) -> None:
    layers = build(database_url)
    sealed = seal(reports(HONEST), CHANNEL, 8)
    layers.deliver(*_batch(sealed, len(HONEST), epoch=8))  # honest control, same run
    honest_verified, honest_invalid = _verified(layers, 8)
    once = seal(reports(HONEST, seed=1), CHANNEL, 7)
    layers.deliver(*_batch(once * 10, 10 * len(HONEST)))  # each fragment 10 times in one part
    verified, invalid = _verified(layers, 7)
    assert honest_invalid == 0 and invalid == 9 * len(once)
    assert verified <= honest_verified + 5 and verified <= len(HONEST)
    assert layers.events.get("fragments_repeated") == 9 * len(once)
    assert _seen(layers) == len(sealed) + len(once)


def test_the_same_fragments_as_both_parts_of_a_batch_count_once(database_url: str) -> None:
    layers = build(database_url)
    sealed = seal(reports(HONEST), CHANNEL, 7)
    batch_id = secrets.token_hex(16)
    for part in (0, 1):
        layers.deliver(*_batch(sealed, 2 * len(HONEST), parts=2, part=part, batch_id=batch_id))
    verified, invalid = _verified(layers, 7)
    assert invalid == len(sealed) and 1 <= verified <= len(HONEST)


def test_a_device_that_sends_to_two_shufflers_costs_the_second_only_its_repeats(
    database_url: str,
) -> None:
    """Shuffler 2's batch carries 100 contributions shuffler 1 counted already: those
    fragments are invalid there, the rest of its batch counts (it is not refused)."""
    layers = build(database_url)
    first = seal(reports(HONEST), CHANNEL, 7)
    layers.deliver(*_batch(first, len(HONEST)))
    counted = _verified(layers, 7)[0]
    both = reports(HONEST[:100])
    second = first[: len(both)] + seal(reports(HONEST, seed=2), CHANNEL, 7)
    layers.deliver(*_batch(second, 100 + len(HONEST), shuffler="shuffler-2"))
    verified, invalid = _verified(layers, 7)
    assert invalid == len(both)
    assert counted + 0.8 * len(HONEST) <= verified <= counted + len(HONEST)


def test_two_analyzer_workers_on_one_database_count_a_fragment_once(database_url: str) -> None:
    """Two workers (their own layers, one database) each fold one batch: the fragments the
    second repeats count once, whichever folds first."""
    one, two = build(database_url), build(database_url)
    sealed = seal(reports(HONEST), CHANNEL, 7)
    one.deliver(*_batch(sealed, len(HONEST)))
    two.deliver(*_batch(sealed, len(HONEST), shuffler="shuffler-2"))
    assert two.events.get("fragments_repeated") == len(sealed)
    assert _verified(one, 7)[1] == len(sealed)


def test_a_fold_that_fails_records_nothing_and_its_retry_counts_every_fragment(
    database_url: str,
) -> None:
    """The seal keys are written in the fold's transaction: a fold that fails after they were
    inserted leaves none behind, in the database or in the worker's memory of the epoch, so
    the part opened again counts all its fragments."""
    layers = build(database_url)
    earlier = seal(reports(HONEST[:100], seed=2), CHANNEL, 7)  # the epoch's record exists
    layers.deliver(*_batch(earlier, 100, shuffler="shuffler-2"))
    sealed = seal(reports(HONEST), CHANNEL, 7)
    layers.intake.accept(*_batch(sealed, len(HONEST)))
    header = layers.store.pending_parts()[0]
    fold_part = layers.store.fold_part

    def failing(h: PartHeader, folding: PartFold, **kw: object) -> object:
        def broken(state: bytes | None, repeated: object) -> tuple[bytes, int]:
            raise RuntimeError("the database went away mid-fold")

        folding.fold = broken  # type: ignore[method-assign,assignment]
        return fold_part(h, folding, **kw)  # type: ignore[arg-type]

    layers.store.fold_part = failing  # type: ignore[method-assign,assignment]
    assert layers.opener.open_pending() == 0  # counted against the part, left stored
    assert _seen(layers) == len(earlier)
    layers.store.fold_part = fold_part  # type: ignore[method-assign]
    assert layers.opener.open_pending() == 1 and header.batch_id
    assert _verified(layers, 7)[1] == 0 and _seen(layers) == len(earlier) + len(sealed)


def test_retention_drops_an_epochs_seal_keys_with_the_epoch(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*_batch(seal(reports(HONEST), CHANNEL, 7), len(HONEST)))
    assert _seen(layers) > 0
    assert layers.store.forget_fragments(before=0.0) == 0  # the epoch is recent: kept
    now = layers.store.clock()
    assert layers.store.forget_fragments(before=now + 1) == len(reports(HONEST))
    assert _seen(layers) == 0


def test_two_workers_folding_the_same_fragments_at_once_count_them_once(
    database_url: str,
) -> None:
    """Two analyzer workers open the two shufflers' batches at the same time (threads, their
    own engines, one database): however their folds interleave, each fragment counts once
    (on PostgreSQL the later insert waits for the earlier commit and its fold is retried)."""
    one, two = build(database_url), build(database_url)
    sealed = seal(reports(HONEST), CHANNEL, 7)
    for shuffler in ("shuffler-1", "shuffler-2"):
        one.intake.accept(*_batch(sealed, len(HONEST), shuffler=shuffler))
    start = threading.Barrier(2)

    def work(layers: Layers) -> None:
        start.wait()
        layers.opener.open_pending()

    threads = [threading.Thread(target=work, args=(layers,)) for layers in (one, two)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    repeated = one.events.get("fragments_repeated") + two.events.get("fragments_repeated")
    assert repeated == len(sealed) and one.store.unopened_parts() == 0
    assert _verified(one, 7)[1] == len(sealed) and _seen(one) == len(sealed)


def test_a_worker_holding_an_epoch_in_memory_reads_what_others_recorded_since(
    database_url: str,
) -> None:
    """Worker one keeps epoch 7's keys in memory; worker two's retention drops the epoch and a
    late batch starts its record again there. One's memory is stale twice over (keys dropped,
    a part it never saw): its next fold follows the database, counting two's fragments as
    seen and none of the dropped ones."""
    one, two = build(database_url), build(database_url)
    sealed = seal(reports(HONEST), CHANNEL, 7)
    one.deliver(*_batch(sealed, len(HONEST)))
    assert two.store.forget_fragments(before=two.store.clock() + 1) == len(sealed)
    fresh = seal(reports(HONEST[:200], seed=1), CHANNEL, 7)
    two.deliver(*_batch(fresh, 200, shuffler="shuffler-2"))
    one.deliver(*_batch(fresh + sealed, 200 + len(HONEST), shuffler="shuffler-3"))
    assert len(fresh) != len(sealed)
    assert two.events.get("fragments_repeated") == 0
    assert one.events.get("fragments_repeated") == len(fresh)
    assert _seen(one) == len(fresh) + len(sealed)
