"""The service facade over a real database: Algorithm 3 end to end (release, hold, purge), the
ledger that accounts for every acknowledged contribution, and no identifiers in a batch."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

from sqlalchemy import select

from common.envelope import new_nonce, verify
from common.randomness import SeededSource
from common.wire import Batch, ChannelPolicy
from shuffler import tables

from .factory import EPOCH_SECONDS, contribute, fill, make_service, pending


def test_epoch_close_releases_one_signed_batch_and_accounts_for_everyone(
    database_url: str, tmp_path: Path
) -> None:
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(1))
    epoch = clock.epoch
    fill(service, epoch, 60)
    assert service.run_batching() == 0  # epoch still open
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    assert service.run_batching() == 1
    assert service.run_batching() == 0  # never evaluated twice
    with service.store.engine.connect() as conn:
        group = conn.execute(select(tables.groups)).one()
        body, signature = conn.execute(
            select(tables.part_bodies.c.body, tables.batch_parts.c.signature).join_from(
                tables.batch_parts,
                tables.part_bodies,
                (tables.part_bodies.c.batch_id == tables.batch_parts.c.batch_id)
                & (tables.part_bodies.c.part == tables.batch_parts.c.part),
            )
        ).one()
    batch = Batch.model_validate_json(body)
    assert group.status == "released" and batch.n_contributions == group.kept
    assert len(batch.fragments) == 2 * group.kept
    assert verify(body, base64.b64decode(signature), service.signing_key.public_key())
    ledger = service.ledger()
    assert ledger["in_batches_unforwarded"] + ledger["deleted_by_algorithm_3"] == 60
    assert ledger["pending"] == 0
    assert service.events.get("batches_released") == 1


def test_small_groups_are_held_then_purged(database_url: str, tmp_path: Path) -> None:
    """8 contributions, min_crowd 5, ε_cr = 1, δ_cr = 1e-3: n̂ = 8 + L − 15.2 < 5 unless
    L ≥ 12.2 (probability 1.1e-3); the seeded draw is such a typical one, so the group is
    held — deterministically — and retention deletes it."""
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(0), retention_seconds=7200.0
    )
    epoch = clock.epoch
    fill(service, epoch, 8)
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    assert service.run_batching() == 1
    with service.store.engine.connect() as conn:
        assert conn.execute(select(tables.groups.c.status)).scalar_one() == "held"
    ledger = service.ledger()
    assert ledger["held"] == 8 and ledger["in_batches_unforwarded"] == 0
    assert service.run_batching() == 0  # a held group is not evaluated again
    clock.now += 7200
    assert service.purge() == 8
    ledger = service.ledger()
    assert ledger["held"] == 0 and ledger["purged"] == 8 and ledger["deleted_by_algorithm_3"] == 0


def test_a_group_is_never_split_by_arrival_and_is_shuffled_whole(
    database_url: str, tmp_path: Path
) -> None:
    """Regression (issue 12: evaluating at a size cap released groups split by arrival order).
    1,200 contributions wait in an open epoch and nothing is evaluated; after the close, ONE
    group is evaluated and its batch is one shuffle of all of it: the first-arrived half's
    fragments and the last-arrived half's are each found in every part."""
    policy = ChannelPolicy(id="homepage", min_crowd=5, eps_cr=5.0, delta_cr=0.1)
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(2), policy=policy, part_fragments=100
    )
    arrivals = 1_200
    for start in range(0, arrivals, 300):
        batch = [
            pending(service, service.tokens.issue(), clock.epoch, tag=tag)
            for tag in range(start, start + 300)
        ]
        assert all(stored.receipt for stored in service.commit(batch))
    assert service.run_batching() == 0
    clock.now += 600  # still inside the epoch
    assert service.run_batching() == 0
    assert service.ledger()["pending"] == arrivals
    with service.store.engine.connect() as conn:
        assert conn.execute(select(tables.groups)).all() == []
    clock.now = (clock.epoch + 1) * EPOCH_SECONDS + 10
    assert service.run_batching() == 1 and service.ledger()["pending"] == 0
    with service.store.engine.connect() as conn:
        group = conn.execute(select(tables.groups)).one()
        bodies = conn.execute(select(tables.part_bodies.c.body)).scalars().all()
    parts = [Batch.model_validate_json(body) for body in bodies]
    assert (group.n, group.status) == (arrivals, "released")
    assert len({p.batch_id for p in parts}) == 1 and len(parts) >= 2 * group.kept / 100
    arrived = [[int.from_bytes(base64.b64decode(f)[:4], "big") for f in p.fragments] for p in parts]
    assert sum(len(tags) for tags in arrived) == 2 * group.kept
    assert all(len(tags) <= 100 for tags in arrived)
    assert all(min(tags) < arrivals // 2 <= max(tags) for tags in arrived)


def test_batch_contains_no_identifiers(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(4))
    epoch = clock.epoch
    sent = []
    for _ in range(80):
        token, nonce = service.tokens.issue(), new_nonce()
        sent.append((token, nonce))
        assert contribute(service, token, epoch, nonce=nonce).receipt
    with service.store.engine.connect() as conn:
        received = conn.execute(select(tables.contributions.c.received_at)).scalars().all()
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    service.run_batching()
    with service.store.engine.connect() as conn:
        body = conn.execute(select(tables.part_bodies.c.body)).scalar_one()
    assert set(json.loads(body)) == {
        "batch_id",
        "part",
        "parts",
        "shuffler_id",
        "channel_id",
        "crowd_id",
        "epoch",
        "n_contributions",
        "fragments",
    }
    for token, nonce in sent:
        client_id = token.split(".")[0]
        for needle in (client_id.encode(), token.encode(), nonce, nonce.hex().encode()):
            assert needle not in body
        assert base64.b64encode(nonce) not in body
    for stamp in received:
        assert str(stamp).encode() not in body and str(int(stamp)).encode() not in body


def test_overlapping_batching_runs_release_each_group_once(
    database_url: str, tmp_path: Path
) -> None:
    """The periodic batcher and an admin close may run at once: one release, no error."""
    service, clock = make_service(database_url, tmp_path)
    fill(service, clock.epoch, 60)
    clock.now = (clock.epoch + 1) * EPOCH_SECONDS + 10
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(service.run_batching())) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 0, 0, 1]
    with service.store.engine.connect() as conn:
        assert len(conn.execute(select(tables.groups)).all()) == 1


def test_contributions_reaching_an_evaluated_group_are_refused_never_acknowledged(
    database_url: str, tmp_path: Path
) -> None:
    """A contribution validated before its epoch ended and committed after the group was
    evaluated (the epoch closed by the clock meanwhile): the evaluation persisted the close
    first, so the commit refuses it (epoch_not_open) rather than acknowledging a contribution
    that could only be purged as late; the group stays evaluated once (one part)."""
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(3))
    epoch = clock.epoch
    fill(service, epoch, 40)
    late = [pending(service, service.tokens.issue(), epoch) for _ in range(25)]
    clock.now = (epoch + 1) * EPOCH_SECONDS + 60.0  # past the end and its grace
    assert service.run_batching() == 1
    before = service.ledger()
    refusals = {stored.refusal.code for stored in service.commit(late) if stored.refusal}
    assert refusals == {"epoch_not_open"}
    assert service.run_batching() == 0
    assert service.ledger() == before
    with service.store.engine.connect() as conn:
        groups = conn.execute(select(tables.groups.c.part)).scalars().all()
    assert groups == [0]
