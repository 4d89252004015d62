"""The contribution store on both dialects: group commit with conflicts sorted out, revocations
and closed epochs that survive a restart, forwarding state, retention, the ledger."""

from __future__ import annotations

import base64
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import DBAPIError, OperationalError

from common.envelope import new_nonce
from common.randomness import SeededSource
from common.wire import Batch, ChannelPolicy
from shuffler import store as store_module
from shuffler import store_backends, store_queries, tables
from shuffler.batcher import Batcher, DealtBatch, Deletion, Evaluation
from shuffler.closing import close_group
from shuffler.errors import (
    EpochNotOpenError,
    QuotaExceededError,
    ReplayedNonceError,
    RevokedTokenError,
)
from shuffler.records import Conflict, GroupKey, PartKey, SealedPart
from shuffler.service import ShufflerService
from shuffler.store import new_receipts
from shuffler.store_backends import (
    PostgresContributionStore,
    SqliteContributionStore,
    make_store,
)

from .factory import EPOCH_SECONDS, POLICY, contribute, fill, make_service, open_files, pending


def test_one_implementation_per_dialect(tmp_path: Path) -> None:
    assert isinstance(
        make_store(create_engine(f"sqlite:///{tmp_path / 'a.db'}")), SqliteContributionStore
    )
    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert isinstance(make_store(engine), PostgresContributionStore)
    with pytest.raises(ValueError, match="unsupported database"):
        make_store(SimpleNamespace(dialect=SimpleNamespace(name="mysql")))  # type: ignore[arg-type]


def test_receipts_are_unique_and_unguessable() -> None:
    receipts = new_receipts(1_000)
    assert len(set(receipts)) == 1_000 and all(len(r) == 32 for r in receipts)


def test_quota_and_replay(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path)
    token, nonce = service.tokens.issue(), new_nonce()
    assert contribute(service, token, clock.epoch, nonce=nonce).receipt
    again = contribute(service, token, clock.epoch)
    assert isinstance(again.refusal, QuotaExceededError) and again.receipt is None
    replay = contribute(service, service.tokens.issue(), clock.epoch, nonce=nonce)
    assert isinstance(replay.refusal, ReplayedNonceError)


def test_a_revocation_by_another_replica_holds_at_once(database_url: str, tmp_path: Path) -> None:
    """Replicas of one trust domain share the database; each keeps the revocations it loaded
    in memory. A client revoked at another replica (a row in ``revoked``, not in this process's
    set) is refused by the insert itself, while the other clients of the same commit land."""
    service, clock = make_service(database_url, tmp_path)
    revoked, other = service.tokens.issue(), service.tokens.issue()
    waiting = [pending(service, revoked, clock.epoch), pending(service, other, clock.epoch)]
    service.store.revoke(waiting[0].client_id, clock())  # as the other replica does
    assert waiting[0].client_id not in service.intake.tokens.revoked
    refused, landed = service.commit(waiting)
    assert isinstance(refused.refusal, RevokedTokenError) and refused.receipt is None
    assert landed.receipt is not None and landed.refusal is None
    assert service.store.ledger()["pending"] == 1


def test_revocations_hold_in_a_commit_checked_in_several_statements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite checks a commit's clients for revocation as many at a time as fit beside its
    channels in :data:`_PARAMETERS_PER_CHECK` (the parameter limit): a revoked client in any
    of the statements is refused, the closed epochs are read with each, and every other
    client lands."""
    monkeypatch.setattr(store_backends, "_PARAMETERS_PER_CHECK", 5)  # 1 channel + 4 clients
    service, clock = make_service(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)
    waiting = [pending(service, service.tokens.issue(), clock.epoch) for _ in range(10)]
    ordered = sorted(waiting, key=lambda p: p.client_id)
    for revoked in (ordered[1], ordered[9]):  # in the first statement and in the third
        service.store.revoke(revoked.client_id, clock())
    stored = dict(zip((p.client_id for p in waiting), service.commit(waiting), strict=True))
    refused = {client for client, s in stored.items() if s.receipt is None}
    assert refused == {ordered[1].client_id, ordered[9].client_id}
    assert all(isinstance(stored[c].refusal, RevokedTokenError) for c in refused)
    assert service.store.ledger()["pending"] == 8


def test_an_admin_close_by_another_replica_holds_at_once(database_url: str, tmp_path: Path) -> None:
    """An admin close answered by one replica persists the closed epoch; another replica,
    whose in-memory ``closed_upto`` has not seen it, must not acknowledge a contribution for
    that epoch (it would only be deleted as late after its 202): the insert reads the closed
    epochs and refuses it with ``epoch_not_open``; what landed before the close stays."""
    service, clock = make_service(database_url, tmp_path)
    early, late = service.tokens.issue(), service.tokens.issue()
    assert contribute(service, early, clock.epoch).receipt
    waiting = pending(service, late, clock.epoch)
    service.store.close_epoch(POLICY.id, clock.epoch, clock())  # as the other replica does
    assert service.intake.closed_upto.get(POLICY.id, -1) < clock.epoch
    assert service.store.insert([waiting]) == [Conflict.CLOSED]
    refused = service.commit([waiting])[0]
    assert isinstance(refused.refusal, EpochNotOpenError) and refused.receipt is None
    assert refused.refusal.code == "epoch_not_open"
    assert service.store.ledger()["pending"] == 1


def test_group_commit_sorts_out_conflicts_inside_one_batch(
    database_url: str, tmp_path: Path
) -> None:
    """One transaction, many rows (the HTTP writer's group commit): a fresh row lands, a row
    reusing its nonce is a replay and a second row of the same client is over quota, even
    when they conflict with each other rather than with rows already stored."""
    service, clock = make_service(database_url, tmp_path)
    epoch = clock.epoch
    first, other, fresh = service.tokens.issue(), service.tokens.issue(), service.tokens.issue()
    nonce = new_nonce()
    landings = service.store.insert(
        [
            pending(service, first, epoch, nonce=nonce),
            pending(service, other, epoch, nonce=nonce),
            pending(service, first, epoch),
            pending(service, fresh, epoch),
        ]
    )
    assert isinstance(landings[0], str) and isinstance(landings[3], str)
    assert landings[0] != landings[3]
    assert landings[1:3] == [Conflict.REPLAYED_NONCE, Conflict.OVER_QUOTA]
    assert service.ledger()["pending"] == 2
    everyone_new = service.commit(
        [pending(service, service.tokens.issue(), epoch) for _ in range(150)]
    )
    receipts = [s.receipt for s in everyone_new]
    assert all(receipts) and len(set(receipts)) == 150 and service.ledger()["pending"] == 152


def test_a_failed_conflict_look_up_keeps_the_receipts_that_landed(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the insert has committed when the look-up of taken nonces runs. If that
    look-up fails (the database drops the connection just then: caused here by making it
    raise), the fresh row keeps its receipt and the refused one is still a conflict, instead
    of the whole batch answering "nothing was stored"."""
    service, clock = make_service(postgres_url, tmp_path)
    nonce = new_nonce()
    assert isinstance(
        service.store.insert([pending(service, service.tokens.issue(), clock.epoch, nonce=nonce)])[
            0
        ],
        str,
    )

    def dropped(*_: object) -> set[bytes]:
        raise OperationalError("SELECT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(store_backends, "nonces_among", dropped)
    landings = service.store.insert(
        [
            pending(service, service.tokens.issue(), clock.epoch, nonce=nonce),
            pending(service, service.tokens.issue(), clock.epoch),
        ]
    )
    assert isinstance(landings[0], Conflict) and isinstance(landings[1], str)
    assert service.store.ledger()["pending"] == 2
    service.store.close()
    service.store.engine.dispose()


def _lock_waits(url: str, at_least: int) -> bool:
    """Whether ``at_least`` backends of the test database wait on a lock (polled up to 10 s)."""
    probe = create_engine(url)
    try:
        for _ in range(500):
            with probe.connect() as conn:
                waiting = conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).scalar_one()
            if waiting >= at_least:
                return True
            time.sleep(0.02)
        return False
    finally:
        probe.dispose()


def test_a_close_waits_for_inserts_that_read_the_epoch_open(
    postgres_url: str, tmp_path: Path
) -> None:
    """Two replicas on one PostgreSQL. Replica A's group commit read the epoch open and then
    waits on replica B's uncommitted row with the same nonce; meanwhile B is told to close
    the epoch. The close waits for A's insert before evaluating the group, so A's fresh
    contribution, acknowledged, is in the evaluated group: not purged as late afterwards."""
    a, clock = make_service(postgres_url, tmp_path / "a")
    b, _ = make_service(postgres_url, tmp_path / "b")
    epoch, nonce = clock.epoch, new_nonce()
    fill(a, epoch, 10)
    held, release = threading.Event(), threading.Event()

    def uncommitted_at_b() -> None:
        with b.store.engine.begin() as conn:
            row = store_queries.contribution_row(
                pending(a, a.tokens.issue(), epoch, nonce=nonce), "r" * 32
            )
            store_backends._insert_rows(conn.connection.cursor(), b.store.mark, [row])
            held.set()
            release.wait(30)

    landings: list[str | Conflict] = []
    batch = [pending(a, a.tokens.issue(), epoch, nonce=nonce), pending(a, a.tokens.issue(), epoch)]
    threads = [
        threading.Thread(target=uncommitted_at_b),
        threading.Thread(target=lambda: landings.extend(a.store.insert(batch))),
        threading.Thread(target=b.close, args=(POLICY.id, epoch)),
    ]
    threads[0].start()
    assert held.wait(10)
    threads[1].start()
    assert _lock_waits(postgres_url, 1)  # A's insert waits on B's row
    threads[2].start()
    close_waited = _lock_waits(postgres_url, 2)  # the close waits on A's insert
    release.set()
    for thread in threads:
        thread.join(30)
    assert landings[0] == Conflict.REPLAYED_NONCE and isinstance(landings[1], str)
    b.run_batching()  # a row that came after the evaluation would be purged here as late
    ledger = a.ledger()
    assert ledger["pending"] == 0 and ledger["purged"] == 0
    assert sum(ledger.values()) == 12  # 10 + B's row + A's fresh one, all in the evaluated group
    assert close_waited
    for service in (a, b):
        service.store.close()
        service.store.engine.dispose()


def test_sqlite_a_close_cannot_commit_between_the_inserts_reads_and_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the group commit takes the write lock before it reads the closed epochs, so a
    close arriving right after that read (made to arrive there) waits for the insert, and the
    acknowledged row is in the evaluated group rather than purged as late."""
    service, clock = make_service(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)
    epoch = clock.epoch
    fill(service, epoch, 10)
    writer, closing = threading.current_thread(), []
    read = store_backends._checks_among

    def a_close_arrives_after_the_read(*args: Any) -> tuple[set[str], dict[str, int]]:
        result = read(*args)
        if threading.current_thread() is writer and not closing:
            closing.append(threading.Thread(target=service.close, args=(POLICY.id, epoch)))
            closing[0].start()
            time.sleep(0.3)  # without the lock, the close commits and evaluates here
        return result

    monkeypatch.setattr(store_backends, "_checks_among", a_close_arrives_after_the_read)
    stored = service.commit([pending(service, service.tokens.issue(), epoch)])
    closing[0].join(30)
    assert stored[0].receipt
    service.run_batching()  # a row that came after the evaluation would be purged here as late
    ledger = service.ledger()
    assert ledger["pending"] == 0 and ledger["purged"] == 0 and sum(ledger.values()) == 11


def test_a_close_gives_up_waiting_for_a_conflicting_lock_and_is_retried(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: while a vacuum-like lock on the contributions table keeps the close's
    barrier waiting (and ingest queued behind it), the barrier gives up after
    ``BARRIER_TIMEOUT_MS``: the close stays persisted (no new contribution is acknowledged for
    the epoch), the group is not evaluated that round, and the next round evaluates it."""
    monkeypatch.setattr(store_backends, "BARRIER_TIMEOUT_MS", 200)
    service, clock = make_service(postgres_url, tmp_path)
    epoch = clock.epoch
    fill(service, epoch, 10)
    holder = create_engine(postgres_url)
    with holder.connect() as conn:
        conn.exec_driver_sql("LOCK TABLE contributions IN SHARE UPDATE EXCLUSIVE MODE")
        with pytest.raises(OperationalError):
            service.store.close_epoch(POLICY.id, epoch, clock.now)
        assert service.store.closed_epochs() == {POLICY.id: epoch}
        clock.now = (epoch + 1) * EPOCH_SECONDS + 60.0
        assert service.run_batching() == 0  # the evaluation's barrier gave up too
        conn.rollback()
    holder.dispose()
    assert service.run_batching() == 1
    assert service.ledger()["pending"] == 0
    service.store.close()
    service.store.engine.dispose()


def _drop_other_connections(url: str) -> int:
    """Terminate every other backend of the test database (a restart, a failover)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            terminated = conn.exec_driver_sql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).scalar_one()
    finally:
        engine.dispose()
    return int(terminated)


def test_a_dropped_insert_connection_costs_at_most_one_refused_commit(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the writer keeps its autocommit connection while busy (no pool ping per
    commit). If the database drops it, that one commit fails and stores nothing (the writer
    answers 503), and the next commit lands on a fresh connection; a connection idle for
    longer than ``HELD_IDLE_SECONDS`` goes back through the pool's ping, so no commit fails."""
    service, clock = make_service(postgres_url, tmp_path)
    monkeypatch.setattr(store_backends, "HELD_IDLE_SECONDS", 600.0)  # no ping on a slow machine
    assert contribute(service, service.tokens.issue(), clock.epoch).receipt
    assert _drop_other_connections(postgres_url) >= 1
    with pytest.raises(DBAPIError):
        contribute(service, service.tokens.issue(), clock.epoch)
    assert service.store.ledger()["pending"] == 1
    assert contribute(service, service.tokens.issue(), clock.epoch).receipt
    monkeypatch.setattr(store_backends, "HELD_IDLE_SECONDS", 0.0)
    assert _drop_other_connections(postgres_url) >= 1
    assert contribute(service, service.tokens.issue(), clock.epoch).receipt
    assert service.store.ledger()["pending"] == 3
    service.store.close()
    service.store.engine.dispose()


def test_revocations_and_closed_epochs_survive_a_restart(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path)
    token = service.tokens.issue()
    service.revoke(token.split(".")[0])
    service.revoke(token.split(".")[0])  # idempotent
    service.close("homepage", clock.epoch - 1)
    service.close("homepage", clock.epoch - 1)
    fresh, _ = make_service(database_url, tmp_path)
    fresh.load_state()
    assert fresh.store.revoked() == {token.split(".")[0]}
    assert fresh.intake.closed_upto == {"homepage": clock.epoch - 1}


def test_forwarding_state_and_retention(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path, retention_seconds=7200.0)
    fill(service, clock.epoch, 60)
    service.close("homepage", clock.epoch)
    due = service.store.due_parts(clock.now)
    claimed = service.store.claim(due[0], clock.now, 60.0)
    assert len(due) == 1 and claimed is not None and claimed.attempts == 0
    service.store.record_retry(due[0], 1, clock.now + 10, "HTTP 503")
    assert service.store.due_parts(clock.now) == []
    again = service.store.claim(service.store.due_parts(clock.now + 10)[0], clock.now + 10, 60.0)
    assert again is not None and again.attempts == 1
    kept = service.ledger()["in_batches_unforwarded"]
    clock.now += 7201
    assert service.purge() == kept
    ledger = service.ledger()
    assert ledger["in_batches_unforwarded"] == 0 and ledger["purged"] == kept
    assert service.events.get("deleted_by_retention") == kept


def _released(service: ShufflerService, epoch: int, crowd: str = "") -> tuple[str, int, int]:
    """Evaluate the group of ``epoch`` (and ``crowd``): its batch (id, contributions, parts)."""
    outcome = close_group(
        service.store, GroupKey("homepage", crowd, epoch), service.batcher, POLICY, service.clock()
    )
    assert outcome is not None and outcome.batch is not None
    return outcome.batch.batch_id, outcome.batch.n_contributions, outcome.batch.parts


def test_retention_purges_a_batch_with_a_refused_part_but_never_one_partly_delivered(
    database_url: str, tmp_path: Path
) -> None:
    """A batch the analyzer refused a part of can never be complete there, so retention purges
    it (cause ``refused``) although its other parts were delivered; a batch with a delivered
    part and none refused may still be completed (and counted) by the analyzer, so it is never
    purged; an undelivered one is purged as ``retention``. Every acknowledged contribution is
    in exactly one state throughout."""
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(41), part_fragments=4, retention_seconds=7200.0
    )
    epochs = (clock.epoch - 3, clock.epoch - 2, clock.epoch - 1)
    clock.now -= 3 * EPOCH_SECONDS  # each group filled in its own open epoch
    for epoch in epochs:
        fill(service, epoch, 30)
        clock.now += EPOCH_SECONDS
    refused, partial, waiting = (_released(service, epoch) for epoch in epochs)
    assert min(refused[2], partial[2]) >= 3, (refused, partial)  # several parts each
    acknowledged = 90

    def conserved() -> dict[str, int]:
        ledger = service.ledger()
        assert sum(ledger.values()) == acknowledged, ledger
        return ledger

    # What a forwarder records: the analyzer took parts 0 and 2 of one batch and refused
    # part 1; it took part 0 of another, whose other parts it has not got yet.
    service.store.record_forwarded(PartKey(refused[0], 0), clock.now)
    service.store.record_failed(PartKey(refused[0], 1), "HTTP 422: below_min_crowd")
    service.store.record_forwarded(PartKey(refused[0], 2), clock.now)
    service.store.record_forwarded(PartKey(partial[0], 0), clock.now)
    before = conserved()
    assert before["in_batches_refused"] == refused[1]
    assert before["in_batches_unforwarded"] == partial[1] + waiting[1]
    assert before["in_batches_forwarded"] == 0  # no batch has every part delivered

    clock.now += 7201  # every batch is past retention
    assert service.store.purge(clock.now - 7200, clock.now) == {
        "retention": waiting[1],
        "refused": refused[1],
    }
    after = conserved()
    assert after["purged"] == refused[1] + waiting[1]
    assert after["in_batches_refused"] == 0 and after["in_batches_unforwarded"] == partial[1]
    _, causes = service.store.ledger_by_cause()
    assert causes["refused"] == refused[1] and causes["retention"] == waiting[1]
    with service.store.engine.connect() as conn:
        kept = set(conn.execute(select(tables.batches.c.batch_id)).scalars())
        parts = conn.execute(
            select(tables.batch_parts.c.batch_id).where(tables.batch_parts.c.batch_id == refused[0])
        ).all()
    assert kept == {partial[0]} and parts == []
    # Much later still: the partly delivered batch stays until the analyzer has every part.
    clock.now += 10 * 7200
    assert service.store.purge(clock.now - 7200, clock.now) == {"retention": 0, "refused": 0}
    assert conserved()["in_batches_unforwarded"] == partial[1]


def test_requeue_puts_refused_parts_back_and_a_requeued_batch_is_not_purged(
    database_url: str, tmp_path: Path
) -> None:
    """``requeue_refused`` makes refused parts pending again, due at once and from the first
    attempt (of one batch, or of all); a batch whose refused part was requeued is an ordinary
    undelivered batch again: with a part delivered it is never purged."""
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(43), part_fragments=4, retention_seconds=7200.0
    )
    clock.now -= 2 * EPOCH_SECONDS
    for epoch in (clock.epoch, clock.epoch + 1):
        fill(service, epoch, 30)
        clock.now += EPOCH_SECONDS
    first, second = (_released(service, e) for e in (clock.epoch - 2, clock.epoch - 1))
    for batch_id, _, _ in (first, second):
        service.store.record_forwarded(PartKey(batch_id, 0), clock.now)
        claimed = service.store.claim(PartKey(batch_id, 1), clock.now, 60.0)
        assert claimed is not None
        service.store.record_retry(PartKey(batch_id, 1), 3, clock.now, "HTTP 503")
        service.store.record_failed(PartKey(batch_id, 1), "HTTP 422: inconsistent_counts")
    due = {(k.batch_id, k.part) for k in service.store.due_parts(clock.now)}
    assert (first[0], 1) not in due and (second[0], 1) not in due  # refused: never re-sent
    assert service.ledger()["in_batches_refused"] == first[1] + second[1]

    assert service.store.requeue_refused(clock.now, "0" * 32) == 0  # no such batch
    assert service.store.requeue_refused(clock.now, first[0]) == 1
    again = service.store.claim(PartKey(first[0], 1), clock.now, 60.0)
    assert again is not None and again.attempts == 0  # from the first attempt
    ledger = service.ledger()
    assert ledger["in_batches_refused"] == second[1]
    assert ledger["in_batches_unforwarded"] == first[1]
    assert service.store.requeue_refused(clock.now) == 1  # every other refused part
    assert service.store.requeue_refused(clock.now) == 0
    assert service.ledger()["in_batches_refused"] == 0

    clock.now += 10 * 7200  # both have a delivered part and none refused: both kept
    assert service.store.purge(clock.now - 7200, clock.now) == {"retention": 0, "refused": 0}
    assert service.ledger()["in_batches_unforwarded"] == first[1] + second[1]


@dataclass
class PausingBatcher(Batcher):
    """A real batcher that stops after the group is locked and counted (its noise draw) until
    the test lets it go, so another transaction can be started against the locked group."""

    locked: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def decide(self, n: int, policy: ChannelPolicy) -> Deletion:
        self.locked.set()
        assert self.go.wait(30)
        return super().decide(n, policy)


def test_a_purge_during_an_evaluation_wins_and_the_evaluation_records_nothing(
    database_url: str, tmp_path: Path
) -> None:
    """Retention runs beside batching, and an evaluation holds no lock while it deals. A purge
    of the same (expired) rows between the evaluation's read and its commit deletes and counts
    them; the evaluation then finds its rows gone and records nothing (no batch, no group, no
    staged part): every contribution is accounted for exactly once, as purged."""
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(7), retention_seconds=7200.0
    )
    fill(service, clock.epoch, 60)
    key = GroupKey("homepage", "", clock.epoch)
    clock.now += 7201  # every contribution is past retention
    batcher = PausingBatcher("shuffler-1", lambda: service.signing_key, SeededSource(8), 16)
    outcome: list[Evaluation | None] = []
    evaluation = threading.Thread(
        target=lambda: outcome.append(close_group(service.store, key, batcher, POLICY, clock.now))
    )
    evaluation.start()
    assert batcher.locked.wait(30)
    assert service.purge() == 60  # not blocked: the evaluation holds no lock yet
    batcher.go.set()
    evaluation.join(60)
    assert outcome == [None]
    ledger = service.ledger()
    assert ledger["purged"] == 60 and ledger["pending"] == 0
    assert ledger["in_batches_unforwarded"] == ledger["deleted_by_algorithm_3"] == 0
    with service.store.engine.connect() as conn:
        assert conn.execute(select(tables.batch_parts)).all() == []
        assert conn.execute(select(tables.groups)).all() == []


@dataclass
class StagingPauseBatcher(Batcher):
    """A real batcher that stops after its first signed part is stored (mid-staging) until the
    test lets it go."""

    staging: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def release(self, *args: Any, **kwargs: Any) -> Iterator[DealtBatch]:  # type: ignore[override]
        return self._paused(*args, **kwargs)

    @contextmanager
    def _paused(self, *args: Any, **kwargs: Any) -> Iterator[DealtBatch]:
        with Batcher.release(self, *args, **kwargs) as release:
            yield DealtBatch(release.batch, self._pause_after_first(release.parts))

    def _pause_after_first(self, parts: Iterator[SealedPart]) -> Iterator[SealedPart]:
        for index, part in enumerate(parts):
            if index == 1:
                self.staging.set()
                assert self.go.wait(60)
            yield part


def test_ingest_goes_on_while_a_group_is_dealt_and_late_rows_are_purged(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 11 (soak): an epoch close held SQLite's only write lock while it read, dealt,
    signed and stored a whole group, so ingest got 503s after the busy timeout. Now staging
    holds no lock: while the evaluation is paused mid-staging, new contributions commit (on
    the lock they would fail after the busy timeout), a forwarder sees no staged part, and
    the rows that reached the group meanwhile are purged as late when the group commits."""
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(21), part_fragments=4)
    fill(service, clock.epoch, 60)
    key = GroupKey("homepage", "", clock.epoch)
    batcher = StagingPauseBatcher("shuffler-1", lambda: service.signing_key, SeededSource(22), 4)
    outcome: list[Evaluation | None] = []
    evaluation = threading.Thread(
        target=lambda: outcome.append(close_group(service.store, key, batcher, POLICY, clock.now))
    )
    evaluation.start()
    try:
        assert batcher.staging.wait(30)
        late = [pending(service, service.tokens.issue(), clock.epoch) for _ in range(2)]
        assert all(stored.receipt for stored in service.commit(late))
        assert service.store.due_parts(clock.now + 1) == []  # staged parts are not sent
    finally:
        batcher.go.set()
        evaluation.join(60)
    assert outcome and outcome[0] is not None and outcome[0].batch is not None
    ledger = service.ledger()
    assert ledger["in_batches_unforwarded"] + ledger["deleted_by_algorithm_3"] == 60
    assert ledger["purged"] == 2 and ledger["pending"] == 0  # the late rows
    assert len(service.store.due_parts(clock.now + 1)) == outcome[0].batch.parts


def test_a_purge_never_deletes_a_batch_whose_lease_is_taken_while_it_looks(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 11 (review): retention's "no part in flight" check was an unlocked read, so a
    forwarder could lease a part between that read and the delete and send a batch the purge
    then counted as deleted. A forwarder's lease, uncommitted while the purge starts, now
    either commits first or finds no part: here it commits, and the batch is kept."""
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(31), part_fragments=8)
    fill(service, clock.epoch, 30)
    outcome = close_group(
        service.store, GroupKey("homepage", "", clock.epoch), service.batcher, POLICY, clock.now
    )
    assert outcome is not None and outcome.batch is not None
    later = clock.now + 10_000
    parts = tables.batch_parts.c
    purged: list[dict[str, int]] = []
    with service.store.engine.connect() as conn:
        lease = conn.begin()
        conn.execute(
            tables.batch_parts.update().where(parts.part == 0).values(lease_until=later + 60)
        )
        purge = threading.Thread(target=lambda: purged.append(service.store.purge(later, later)))
        purge.start()
        time.sleep(0.5)  # let the purge read the unleased batch (same outcome if it has not)
        lease.commit()
    purge.join(60)
    assert purged == [{"retention": 0, "refused": 0}]
    ledger = service.ledger()
    assert (
        ledger["purged"] == 0 and ledger["in_batches_unforwarded"] == outcome.batch.n_contributions
    )


def _tagged_group(service: ShufflerService, epoch: int, count: int) -> None:
    batch = [pending(service, service.tokens.issue(), epoch, tag=t) for t in range(count)]
    assert all(stored.receipt for stored in service.commit(batch))


def test_evaluation_streams_the_group_and_conserves_every_survivor(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny pages and chunks (so locking, reading and dealing all take many rounds): the parts
    hold exactly the fragments of ``kept`` whole contributions, each once; the others are
    deleted; no spill file is left in the data directory."""
    monkeypatch.setattr(store_queries, "_LOCK_PAGE", 7)
    for module in (store_module, store_backends):  # SQLite's reads and PostgreSQL's
        monkeypatch.setattr(module, "READ_ROWS", 5)
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(12), part_fragments=9)
    _tagged_group(service, clock.epoch, 83)
    spill = service.store.spill_directory()
    assert spill == (tmp_path if database_url.startswith("sqlite") else None)
    before = sorted(p.name for p in tmp_path.iterdir())
    outcome = close_group(
        service.store, GroupKey("homepage", "", clock.epoch), service.batcher, POLICY, clock.now
    )
    assert outcome is not None and outcome.batch is not None
    kept = outcome.deletion.kept
    with service.store.engine.connect() as conn:
        bodies = conn.execute(select(tables.part_bodies.c.body)).scalars().all()
        stored = conn.execute(select(tables.batches.c.parts)).scalar_one()
    parts = [Batch.model_validate_json(b) for b in bodies]
    fragments = [base64.b64decode(f) for p in parts for f in p.fragments]
    owners = Counter(int.from_bytes(f[:4], "big") for f in fragments)
    assert len(owners) == kept and set(owners.values()) == {2} and set(owners) <= set(range(83))
    assert len(set(fragments)) == 2 * kept == outcome.batch.fragments
    assert len(parts) == stored == outcome.batch.parts and all(len(p.fragments) <= 9 for p in parts)
    ledger = service.ledger()
    assert ledger["pending"] == 0 and ledger["deleted_by_algorithm_3"] == 83 - kept
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@dataclass
class FailingBatcher(Batcher):
    """A real batcher whose storage fails after the first part is stored (as a full disk or a
    dropped connection would)."""

    def release(self, *args: Any, **kwargs: Any) -> Iterator[DealtBatch]:  # type: ignore[override]
        return self._failing(*args, **kwargs)

    @contextmanager
    def _failing(self, *args: Any, **kwargs: Any) -> Iterator[DealtBatch]:
        with Batcher.release(self, *args, **kwargs) as release:
            yield DealtBatch(release.batch, _then_fail(release.parts))


def _then_fail(parts: Iterator[SealedPart]) -> Iterator[SealedPart]:
    yield next(parts)
    raise OSError("no space left on device")


def test_a_failed_evaluation_stores_nothing_and_leaves_no_spill(
    database_url: str, tmp_path: Path
) -> None:
    """One transaction: a failure while storing parts rolls back the parts, the deletions and
    the group's record, and the spill file is closed (the group is evaluated again later)."""
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(13), part_fragments=5)
    fill(service, clock.epoch, 40)
    key = GroupKey("homepage", "", clock.epoch)
    failing = FailingBatcher("shuffler-1", lambda: service.signing_key, SeededSource(14), 5)
    with pytest.raises(OSError, match="no space"):
        close_group(service.store, key, failing, POLICY, clock.now)
    ledger = service.ledger()
    assert ledger["pending"] == 40 and ledger["in_batches_unforwarded"] == 0
    with service.store.engine.connect() as conn:
        assert conn.execute(select(tables.groups)).all() == []
        assert conn.execute(select(tables.batch_parts)).all() == []
    assert not [f for f in open_files() if "esa-deal-" in f]
    outcome = close_group(service.store, key, service.batcher, POLICY, clock.now)
    assert outcome is not None and service.ledger()["pending"] == 0


def test_an_evaluated_group_leaves_its_rows_dead_until_swept_and_the_ledger_holds(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close records the group and touches none of its rows; from then on they are dead:
    no longer waiting, never evaluated again, never purged by retention (their group counts
    them), and the sweep deletes them in short chunks without moving the ledger. A held
    group's rows are not dead: retention still purges them."""
    monkeypatch.setattr(store_module, "SWEEP_CHUNK", 7)
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(12))
    received = clock.now
    released = GroupKey("homepage", "", clock.epoch)
    fill(service, clock.epoch, 40)
    held = GroupKey("homepage", "", clock.epoch + 1)
    clock.now += EPOCH_SECONDS
    fill(service, held.epoch, 3)  # below min_crowd = 5: held
    clock.now += EPOCH_SECONDS
    fill(service, clock.epoch, 4)  # the current epoch: waiting
    for key in (released, held):
        service.store.close_epoch("homepage", key.epoch, clock.now)
        assert close_group(service.store, key, service.batcher, POLICY, clock.now) is not None
    ledger = service.ledger()
    assert ledger["pending"] == 4 and ledger["held"] == 3
    kept = ledger["in_batches_unforwarded"]
    assert 0 < kept <= 40 and kept + ledger["deleted_by_algorithm_3"] == 40
    assert _count(service) == 40 + 3 + 4  # dead rows stay until the sweep
    assert service.store.open_groups() == [GroupKey("homepage", "", clock.epoch)]
    assert close_group(service.store, released, service.batcher, POLICY, clock.now) is None
    # retention before the sweep: the released group's rows are older than the cutoff, its
    # batch is not; the dead rows are not purged (nor counted) a second time
    assert service.store.purge(cutoff=received + 1, now=clock.now)["retention"] == 0
    assert service.ledger() == ledger and _count(service) == 47
    assert service.store.sweep(budget=14) == 14  # two chunks, then it returns
    assert service.ledger() == ledger
    assert service.sweep() == 40 - 14 and service.sweep() == 0
    assert _count(service) == 3 + 4 and service.ledger() == ledger
    removed = service.store.purge(cutoff=clock.now + 1, now=clock.now)
    assert removed["retention"] == 3 + 4 + kept  # the held, the waiting and the old batch
    after = service.ledger()
    assert after["held"] == after["pending"] == after["in_batches_unforwarded"] == 0
    assert after["purged"] == 7 + kept and after["deleted_by_algorithm_3"] == 40 - kept


def _count(service: ShufflerService) -> int:
    with service.store.engine.connect() as conn:
        query = select(func.count()).select_from(tables.contributions)
        return int(conn.execute(query).scalar_one())


def test_a_purge_racing_a_groups_commit_never_counts_its_rows_twice(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close leaves a group's rows in place, dead; a retention purge that starts while the
    close's final transaction is open (its rows locked, its group not yet committed) waits
    for it and then sees the group: the rows are counted once, by the group, never as purged."""
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(41), retention_seconds=7200.0
    )
    received = clock.now
    fill(service, clock.epoch, 40)
    key = GroupKey("homepage", "", clock.epoch)
    clock.now += 7201  # the rows are past retention; the batch will not be
    applying, go = threading.Event(), threading.Event()
    original = store_module.apply_outcome

    def slow_apply(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        applying.set()
        assert go.wait(30)

    monkeypatch.setattr(store_module, "apply_outcome", slow_apply)
    outcome: list[Evaluation | None] = []
    purged: list[dict[str, int]] = []
    evaluation = threading.Thread(
        target=lambda: outcome.append(
            close_group(service.store, key, service.batcher, POLICY, clock.now)
        )
    )
    evaluation.start()
    assert applying.wait(30)
    purge = threading.Thread(
        target=lambda: purged.append(service.store.purge(cutoff=received + 1, now=clock.now))
    )
    purge.start()
    time.sleep(0.5)  # the purge is waiting on the close's locks (or has not read yet)
    go.set()
    evaluation.join(60)
    purge.join(60)
    assert outcome and outcome[0] is not None
    assert purged == [{"retention": 0, "refused": 0}]
    ledger = service.ledger()
    assert ledger["purged"] == 0 and ledger["pending"] == 0
    assert ledger["in_batches_unforwarded"] + ledger["deleted_by_algorithm_3"] == 40


def test_a_batch_the_analyzer_would_withhold_is_held_instead(
    database_url: str, tmp_path: Path
) -> None:
    """A released group whose fragments would verify fewer than ``min_crowd`` contributions at
    the analyzer (a random fragment count's lower bound) is held here, as Algorithm 3 holds a
    small group: nothing is sent to be withheld, every contribution stays accounted as held."""
    service, clock = make_service(database_url, tmp_path, rng=SeededSource(43))
    epochs = (clock.epoch - 2, clock.epoch - 1)
    clock.now -= 2 * EPOCH_SECONDS
    for epoch in epochs:
        fill(service, epoch, 40)
        clock.now += EPOCH_SECONDS
    seen: list[tuple[int, int]] = []

    def short(kept: int, fragments: int) -> int:
        seen.append((kept, fragments))
        return POLICY.min_crowd - 1

    def close(epoch: int, crowd: Callable[[int, int], int]) -> Evaluation | None:
        key = GroupKey("homepage", "", epoch)
        return close_group(service.store, key, service.batcher, POLICY, clock.now, crowd)

    held = close(epochs[0], short)
    assert held is not None and held.batch is None and held.deletion.status == "held"
    assert seen and seen[0][1] > 0  # asked with the survivors' fragments
    assert held.deletion.deleted == 0
    kept = close(epochs[1], lambda k, f: k)
    assert kept is not None and kept.batch is not None
