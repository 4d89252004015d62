"""The contribution store: every transaction the shuffler runs, behind one interface.

:class:`ContributionStore` opens the transactions (:func:`runtime.db.run_tx`), one per step of
what the service sequences (a group's evaluation: :mod:`shuffler.closing`); the
dialect-neutral queries each step runs inside one transaction are in
:mod:`shuffler.store_queries` (SQLAlchemy Core over the tables of :mod:`shuffler.tables`).
:class:`~shuffler.store_backends.SqliteContributionStore` and
:class:`~shuffler.store_backends.PostgresContributionStore` supply what differs (the
insert-ignore construct, the driver's placeholder, connection tuning), and
:func:`~shuffler.store_backends.make_store` picks one for an engine; nothing else in the
shuffler looks at the dialect.

What it guarantees (docs/protocol.md, "Delivery guarantees"): a receipt only after its commit; a
group evaluated once, whole, with the write lock held only for a short final step; a part sent
by one forwarder at a time (a lease). The protocol and why it holds: docs/shuffler.md,
"Storage, locking and durability".
"""

from __future__ import annotations

import contextlib
import functools
import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from sqlalchemy import Table, delete, exists, func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.dml import Insert

from common.wire import ChannelPolicy
from runtime import db
from runtime.conservation import LEDGER_CAUSES
from runtime.failpoints import failpoint
from shuffler import tables
from shuffler.batcher import DealtBatch, Deletion, GroupStatus, ReleasedBatch
from shuffler.records import Conflict, DuePart, EpochGroups, GroupKey, PartKey, Pending
from shuffler.store_queries import (
    Ids,
    Landings,
    Row,
    VanishedError,
    apply_outcome,
    closed_among,
    contribution_row,
    dead_ids,
    delete_ids,
    delete_orphans,
    delete_parts,
    expired,
    followed_policy,
    forwarded_by_epoch,
    group_keys,
    group_rows,
    landing,
    lock_parts,
    newest_epochs,
    part_filter,
    publish,
    purge_late,
    stage_part,
    stale_batches,
    times_evaluated,
    unleased,
    waiting_groups,
)

#: The key of a followed channel's stored row that says why it is suspended
#: (:class:`shuffler.policies.ChannelPolicies`: it takes no more contributions).
SUSPENDED_KEY = "suspended"
#: How long a staged part may wait for its evaluation to commit before retention deletes it as
#: left behind by a crash (far above the 334 s an epoch of 10^6 contributions took to close).
STAGED_GRACE_SECONDS = 6 * 3600.0
UNSTAGE_ATTEMPTS = 5
#: Dead contributions (of evaluated groups) deleted per transaction by ``sweep``.
SWEEP_CHUNK = 2_000
#: Survivors whose packed fragments are read per query while dealing (~2 KB each for a
#: k-RAPPOR contribution of 30 fragments: a few MB per chunk, whatever the group's size).
READ_ROWS = 2_000
#: Batch parts forwarded per round (bounds one round's time when the analyzer is slow).
FORWARD_ROUND = 32


def new_receipts(count: int) -> list[str]:
    """``count`` unique, unguessable receipts: 32 hex digits, the time in microseconds (13)
    then 76 random bits (19).

    The time prefix makes a batch's receipts neighbours in the unique index, so a commit
    touches one index page for all of them instead of one random page each (the write-ahead
    log copies every page a commit touches). A receipt only ever goes back to the client
    that sent the contribution, which knows when it did.
    """
    prefix = f"{time.time_ns() // 1000:013x}"
    random = secrets.token_hex(10 * count)  # one system call for the whole batch
    return [prefix + random[20 * i : 20 * i + 19] for i in range(count)]


class ContributionStore(ABC):
    """Contributions, groups, batches, purges, revocations and closed epochs of one shuffler."""

    #: The DB-API placeholder of the dialect's driver.
    mark: ClassVar[str]
    #: The statement that opens a read transaction with one snapshot for all its reads.
    snapshot_sql: ClassVar[str]

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @abstractmethod
    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` in this dialect."""

    # --- intake ---------------------------------------------------------------------------

    def insert(self, pending: Sequence[Pending]) -> list[str | Conflict]:
        """Commit contributions in ONE transaction (group commit): a receipt per row that
        landed, else why not (the client is revoked, the epoch closed, the nonce replayed or
        the quota exceeded).

        The revocations and closed epochs are read in the same transaction as the insert
        (:meth:`_insert_checked`): a replica of the same trust domain may have revoked a client
        or closed an epoch since this process loaded them, and what any replica answered must
        hold at every replica from then on.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the database is unavailable (nothing stored).
        """
        receipts = new_receipts(len(pending))
        rows = [contribution_row(p, r) for p, r in zip(pending, receipts, strict=True)]
        revoked, closed, landed, taken = self._insert_checked(rows)
        return [landing(row, landed, taken, revoked, closed) for row in rows]

    @abstractmethod
    def _insert_checked(self, rows: list[Row]) -> Landings:
        """One transaction: read which clients are revoked and which epochs closed, insert the
        other rows unless they replay a nonce or exceed the quota; (revoked, closed, receipts
        landed, nonces already taken)."""

    def close(self) -> None:  # noqa: B027 (a hook: a store may hold a connection)
        """Give back any connection the store holds (before the engine is disposed)."""

    def claim_file(self) -> None:  # noqa: B027 (a hook: only SQLite has a file to claim)
        """Claim the database for this process before anything changes it (migrations
        included)."""

    def start_writing(self) -> None:  # noqa: B027 (a hook: only SQLite prepares)
        """Prepare this process to insert contributions, before the server answers any."""

    def revoke(self, client_id: str, now: float) -> None:
        """Persist a revocation (idempotent)."""
        query = self.insert_ignore(tables.revoked).values(client_id=client_id, revoked_at=now)
        db.run_tx(self.engine, "shuffler.revoke", lambda conn: conn.execute(query))

    def revoked(self) -> set[str]:
        """Every revoked client id."""
        with self.engine.connect() as conn:
            return set(conn.execute(select(tables.revoked.c.client_id)).scalars())

    def close_epoch(self, channel_id: str, epoch: int, now: float) -> None:
        """Persist that every epoch <= ``epoch`` of a channel is closed (idempotent)."""
        values = {"channel_id": channel_id, "epoch": epoch, "closed_at": now}
        query = self.insert_ignore(tables.closed_epochs).values(**values)
        db.run_tx(
            self.engine, "shuffler.close_epoch", lambda conn: conn.execute(query), counted=False
        )

    def closed_epochs(self) -> dict[str, int]:
        """The latest closed epoch of each channel."""
        with self.engine.connect() as conn:
            return closed_among(conn)

    def follow(
        self,
        policies: Sequence[ChannelPolicy],
        revision: int,
        suspended: Mapping[str, str] | None = None,
    ) -> None:
        """Persist the channel policies (or whole privacy terms) adopted at config ``revision``
        (one row per channel, replaced: a retirement rewrites the channel's row), with why a
        channel in ``suspended`` takes no more contributions."""
        f = tables.followed_channels
        suspended = suspended or {}

        def replace(conn: Connection) -> None:
            for policy in policies:
                conn.execute(delete(f).where(f.c.channel_id == policy.id))
                row = policy.model_dump(mode="json")
                if policy.id in suspended:
                    row[SUSPENDED_KEY] = suspended[policy.id]
                values = {"policy": json.dumps(row), "version": revision}
                conn.execute(insert(f).values(channel_id=policy.id, **values))

        db.run_tx(self.engine, "shuffler.follow", replace)

    def follow_key(self, party: str, signing_key: str) -> None:
        """Persist the signing key this shuffler follows for ``party`` (base64)."""
        k = tables.followed_keys

        def replace(conn: Connection) -> None:
            conn.execute(delete(k).where(k.c.party == party))
            conn.execute(insert(k).values(party=party, signing_key=signing_key))

        db.run_tx(self.engine, "shuffler.follow_key", replace)

    def followed_key(self, party: str) -> str | None:
        """The signing key followed for ``party`` (None: none yet)."""
        k = tables.followed_keys.c
        with self.engine.connect() as conn:
            found = conn.execute(select(k.signing_key).where(k.party == party)).scalar()
        return None if found is None else str(found)

    def followed(self) -> tuple[list[ChannelPolicy], int, dict[str, str]]:
        """The adopted channel policies (:class:`~common.terms.ChannelTerms` where a config
        stated the channel's privacy terms), the newest revision they were adopted at, and the
        suspended channels with why."""
        f = tables.followed_channels.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(f.policy, f.version)).all()
        policies, suspended = [], {}
        for text, _ in rows:
            stored = json.loads(text)
            why = stored.pop(SUSPENDED_KEY, None)
            policies.append(followed_policy(stored))
            if why is not None:
                suspended[policies[-1].id] = str(why)
        return policies, max((int(version) for _, version in rows), default=0), suspended

    # --- batching -------------------------------------------------------------------------

    def open_groups(self) -> list[GroupKey]:
        """Every group with contributions awaiting evaluation (one short query per group:
        the batching round asks every second, while the table holds a whole epoch)."""
        with self.engine.connect() as conn:
            return group_keys(conn, evaluated=False)

    @contextlib.contextmanager
    def exclusive(self, key: GroupKey) -> Iterator[bool]:
        """Whether this process may evaluate ``key`` now: always on SQLite (one process per
        database, its batching serialized); PostgreSQL overrides it with an advisory lock, so
        replicas do not deal the same group twice only for one of them to discard it."""
        yield True

    def group_to_evaluate(self, key: GroupKey) -> tuple[Ids, Ids] | None:
        """The group's waiting contributions as (ids, fragment counts), read without the write
        lock (:func:`shuffler.closing.close_group`'s first step); None when nothing waits or
        the group was evaluated already (its rows are dead, awaiting the sweep)."""
        with self.engine.connect() as conn:
            ids, sizes = group_rows(conn, key, lock=False)
            evaluated = times_evaluated(conn, key)
        return None if not ids.size or evaluated else (ids, sizes)

    @abstractmethod
    def begin_writing(self, conn: Connection) -> None:
        """Start ``conn``'s transaction as a writer (before :meth:`record_group` reads the
        group again)."""

    def spill_directory(self) -> Path | None:
        """Where the streamed shuffle's temporary file goes (None: the system's)."""
        return None

    def survivor_fragments(
        self, key: GroupKey, survivors: Ids
    ) -> Generator[list[bytes], None, None]:
        """The survivors' packed fragments, in chunks, on a connection of their own that the
        iterator holds until it is exhausted or closed (close it once they are dealt).

        Raises:
            VanishedError: a survivor's row was deleted meanwhile (a retention purge).
        """
        with self.engine.connect() as conn:
            yield from self.packed(conn, key, survivors)

    def packed(self, conn: Connection, key: GroupKey, survivors: Ids) -> Iterator[list[bytes]]:
        """The survivors' packed fragments, :data:`READ_ROWS` contributions at a time, by
        ``IN`` lists of their ids (SQLite reads a row by its id in microseconds).

        Raises:
            VanishedError: a survivor's row was deleted meanwhile (a retention purge).
        """
        c = tables.contributions.c
        for start in range(0, survivors.size, READ_ROWS):
            chunk = survivors[start : start + READ_ROWS].tolist()
            rows = conn.execute(select(c.fragments).where(c.id.in_(chunk))).scalars()
            blobs = [bytes(blob) for blob in rows]
            if len(blobs) != len(chunk):
                raise VanishedError(f"{len(chunk) - len(blobs)} contributions vanished")
            yield blobs

    def stage_parts(self, release: DealtBatch, now: float) -> None:
        """Insert each signed part ``staged`` as it is yielded (one part's body in memory, one
        short transaction each); on any failure delete what was staged.

        Raises:
            RuntimeError: the parts yielded are not the parts the batch announced.
        """
        batch, parts = release.batch, 0
        try:
            for sealed in release.parts:
                # Retried as a whole: the part is signed already (outside), the body only
                # inserts it. Not counted: one per part of a batch (docs/shuffler.md, "Metrics").
                stage = functools.partial(stage_part, sealed=sealed, now=now)
                db.run_tx(self.engine, "shuffler.stage_part", stage, counted=False)
                parts += 1
            if parts != batch.parts:
                raise RuntimeError(
                    f"batch {batch.batch_id} announced {batch.parts} parts, made {parts}"
                )
        except BaseException:
            self.unstage(batch.batch_id)
            raise

    def record_group(
        self, key: GroupKey, ids: Ids, deletion: Deletion, batch: ReleasedBatch | None, now: float
    ) -> bool:
        """The last step of a group's evaluation, under the write lock: its outcome and batch
        recorded, and the late arrivals purged; False when another worker evaluated the group
        first or a row read in the first step vanished.

        Run once (``attempts=1``): Algorithm 3's draw (``deletion``) and the signed ``batch``
        were made before it, and a failure here leaves the group to the next round, which draws
        afresh only if nothing committed (docs/shuffler.md, "Evaluating a group"); an
        ``IntegrityError`` (another worker recorded the group first) reaches the caller. Not
        counted: one per group evaluated, whatever its outcome."""

        def record(conn: Connection) -> bool:
            self.begin_writing(conn)
            part = times_evaluated(conn, key)
            if part:
                return False
            current, _ = group_rows(conn, key, lock=True)
            if np.setdiff1d(ids, current, assume_unique=True).size:
                return False
            purge_late(conn, np.setdiff1d(current, ids, assume_unique=True), now)
            if batch is not None:
                publish(conn, key, batch, now)
            apply_outcome(conn, key, part, ids, deletion, now)
            failpoint("shuffler.close.group_before_commit")
            return True

        return db.run_tx(self.engine, "shuffler.record_group", record, attempts=1, counted=False)

    def unstage(self, batch_id: str) -> None:
        """Delete a batch's staged parts (an evaluation that did not commit), trying a few
        times: the failure that stopped the evaluation may be a dropped connection. What a
        crash leaves behind, retention deletes (:data:`STAGED_GRACE_SECONDS`)."""
        p = tables.batch_parts.c
        # Any OperationalError (a dropped connection too), retried; not counted (per batch).
        db.run_tx(
            self.engine,
            "shuffler.unstage",
            lambda conn: delete_parts(conn, p.batch_id == batch_id, p.status == "staged"),
            attempts=UNSTAGE_ATTEMPTS,
            retry_on=(OperationalError,),
            backoff=0.2,
            counted=False,
        )

    # --- forwarding -----------------------------------------------------------------------

    def due_parts(self, now: float) -> list[PartKey]:
        """Undelivered parts whose next attempt is due and that no forwarder holds, oldest
        first (one round); a forwarder must :meth:`claim` each before sending it."""
        p = tables.batch_parts.c
        query = (
            select(p.batch_id, p.part)
            .where(p.status == "pending", p.next_attempt_at <= now, unleased(now))
            .order_by(p.created_at, p.batch_id, p.part)
            .limit(FORWARD_ROUND)
        )
        with self.engine.connect() as conn:
            return [PartKey(batch_id, int(part)) for batch_id, part in conn.execute(query)]

    def claim(self, key: PartKey, now: float, lease_seconds: float) -> DuePart | None:
        """Take the part's forwarding lease until ``now + lease_seconds``; None when another
        forwarder holds it or it was delivered meanwhile.

        One conditional ``UPDATE`` decides: PostgreSQL re-checks its ``WHERE`` on the row it
        locked and SQLite serializes writers, so of two racing forwarders exactly one sees a
        row updated (docs/protocol.md: exactly one forwarder at a time).
        """
        p = tables.batch_parts.c

        def take(conn: Connection) -> Row | None:
            taken = conn.execute(
                update(tables.batch_parts)
                .where(*part_filter(key), p.status == "pending", unleased(now))
                .values(lease_until=now + lease_seconds)
            ).rowcount
            if taken != 1:
                return None
            body = tables.part_bodies.c
            return conn.execute(
                db.binary_rows(
                    select(body.body, p.signature, p.attempts)
                    .join_from(
                        tables.batch_parts,
                        tables.part_bodies,
                        (body.batch_id == p.batch_id) & (body.part == p.part),
                    )
                    .where(*part_filter(key))
                )
            ).one()

        row = db.run_tx(self.engine, "shuffler.claim_part", take)
        if row is None:
            return None
        return DuePart(
            batch_id=key.batch_id,
            part=key.part,
            body=row[0],
            signature=row[1],
            attempts=int(row[2]),
        )

    def record_forwarded(self, key: PartKey, now: float) -> None:
        """The analyzer acknowledged the part; the batch is forwarded once all its parts are.

        The batch row is locked first (PostgreSQL), so when the last two parts are acknowledged
        concurrently the second transaction sees the first's part and marks the batch.
        """
        p, b = tables.batch_parts.c, tables.batches.c
        waiting = exists().where(p.batch_id == key.batch_id, p.status != "forwarded")

        def record(conn: Connection) -> None:
            conn.execute(select(b.batch_id).where(b.batch_id == key.batch_id).with_for_update())
            conn.execute(
                update(tables.batch_parts)
                .where(*part_filter(key))
                .values(status="forwarded", forwarded_at=now, lease_until=None, last_error=None)
            )
            conn.execute(
                update(tables.batches)
                .where(b.batch_id == key.batch_id, b.status != "forwarded", ~waiting)
                .values(status="forwarded", forwarded_at=now)
            )
            failpoint("shuffler.forward.ack_before_commit")

        db.run_tx(self.engine, "shuffler.record_forwarded", record)
        failpoint("shuffler.forward.ack_after_commit")

    def record_failed(self, key: PartKey, error: str) -> None:
        """The analyzer refused the part's content for good; it stays stored (counted as
        undelivered) until retention deletes it."""
        self._update_part(key, status="failed", lease_until=None, last_error=error)

    def record_retry(self, key: PartKey, attempts: int, next_attempt_at: float, error: str) -> None:
        """The attempt failed; try again at ``next_attempt_at`` (the lease is released)."""
        self._update_part(
            key, attempts=attempts, next_attempt_at=next_attempt_at, lease_until=None,
            last_error=error,
        )  # fmt: skip

    def _update_part(self, key: PartKey, **changes: Any) -> None:
        # Only a part still pending: a forwarder whose lease ran out must not mark failed (or
        # reschedule) a part another forwarder has meanwhile delivered.
        pending = tables.batch_parts.c.status == "pending"
        query = update(tables.batch_parts).where(*part_filter(key), pending).values(**changes)
        db.run_tx(self.engine, "shuffler.update_part", lambda conn: conn.execute(query))

    # --- retention and accounting ---------------------------------------------------------

    def purge(self, cutoff: float, now: float) -> dict[str, int]:
        """Delete contributions and undelivered batches older than ``cutoff``, and staged
        parts an evaluation left behind (a crash between staging and committing); the
        contributions deleted are recorded by reason (in one transaction) and returned:
        ``refused`` for batches the analyzer refused a part of, ``retention`` for the rest.

        A batch with a part being sent (leased), or delivered while none of its parts was
        refused, is not purged: the analyzer may count it, and a purge would then count the
        same contributions twice. A batch with a refused part can never be complete at the
        analyzer (the refused part is never re-sent unless an admin requeues it), so it is
        purged even though its other parts were delivered. The candidates' parts are locked
        (``FOR UPDATE``; SQLite's writer lock, taken first) and the condition checked again
        under the lock, so a forwarder's lease or a requeue between the two reads either
        commits first (the batch is kept) or waits and finds the batch gone.
        """
        return db.run_tx(
            self.engine, "shuffler.purge", functools.partial(self._purge, cutoff=cutoff, now=now)
        )

    def _purge(self, conn: Connection, cutoff: float, now: float) -> dict[str, int]:
        """:meth:`purge`'s transaction."""
        b = tables.batches.c
        self.begin_writing(conn)
        old = expired(conn, cutoff)
        stale = stale_batches(conn, cutoff, now)
        if stale:
            lock_parts(conn, list(stale))
            stale = stale_batches(conn, cutoff, now, among=list(stale))
        removed = {"retention": delete_ids(conn, old), "refused": 0}
        if stale:
            ids = list(stale)
            delete_parts(conn, tables.batch_parts.c.batch_id.in_(ids))
            conn.execute(delete(tables.batches).where(b.batch_id.in_(ids)))
        delete_orphans(conn, now - STAGED_GRACE_SECONDS)
        for n, refused in stale.values():
            removed["refused" if refused else "retention"] += n
        rows = [
            {"reason": reason, "contributions": n, "purged_at": now}
            for reason, n in removed.items()
            if n
        ]
        if rows:
            conn.execute(insert(tables.purges), rows)
        return removed

    def requeue_refused(self, now: float, batch_id: str | None = None) -> int:
        """Send the parts the analyzer refused again (of ``batch_id``, or of every batch), from
        the first attempt on: after an operator fixed what the analyzer refused them for.
        Returns how many parts were requeued."""
        p = tables.batch_parts.c
        query = update(tables.batch_parts).where(p.status == "failed")
        if batch_id is not None:
            query = query.where(p.batch_id == batch_id)
        query = query.values(status="pending", attempts=0, next_attempt_at=now)
        return db.run_tx(
            self.engine, "shuffler.requeue_refused", lambda conn: int(conn.execute(query).rowcount)
        )

    def sweep(self, budget: int = 20 * SWEEP_CHUNK) -> int:
        """Delete up to ``budget`` dead contributions (of groups already evaluated, counted by
        their ``groups`` row), :data:`SWEEP_CHUNK` per short transaction; returns how many
        were deleted (0: none left). Off the close's path, so a big group's rows leave without
        holding the write lock for long; the count is the shuffler's own (never published: a
        group's size is secret unless released)."""
        with self.engine.connect() as conn:  # dead stays dead: found without the write lock
            dead = group_keys(conn, evaluated=True)
        swept = 0
        for key in dead:
            while swept < budget:
                # Not counted: the number of chunks would reveal the dead rows' count.
                chunk = functools.partial(self._sweep_chunk, key=key)
                deleted = db.run_tx(self.engine, "shuffler.sweep", chunk, counted=False)
                swept += deleted
                if deleted < SWEEP_CHUNK:
                    break
        return swept

    def _sweep_chunk(self, conn: Connection, key: GroupKey) -> int:
        """Delete up to :data:`SWEEP_CHUNK` dead rows of ``key`` (:meth:`sweep`'s transaction)."""
        self.begin_writing(conn)
        return delete_ids(conn, dead_ids(conn, key, SWEEP_CHUNK))

    def ledger(self) -> dict[str, int]:
        """Where every acknowledged contribution went (for audits, metrics and tests)."""
        return self.ledger_by_cause()[0]

    def ledger_by_cause(self) -> tuple[dict[str, int], dict[str, int]]:
        """The ledger (disjoint states: pending, held, in batches forwarded, not yet forwarded
        or with a part the analyzer refused, deleted by Algorithm 3, purged; their sum is every
        contribution ever acknowledged) and its deletions by cause (:data:`LEDGER_CAUSES`:
        ``groups.deleted`` by status, purges by reason; a purge reason not listed keeps its
        name), read in ONE snapshot (:meth:`_snapshot`): a batch forwarded or a group
        evaluated between separate reads would be counted twice or not at all."""
        c, b, g, p = (t.c for t in (tables.contributions, tables.batches, tables.groups,
                                    tables.purges))  # fmt: skip
        count = select(func.count()).select_from(tables.contributions)
        in_batches = select(func.sum(b.n_contributions))
        refused = exists().where(
            tables.batch_parts.c.batch_id == b.batch_id, tables.batch_parts.c.status == "failed"
        )
        queries = {
            "held": count.where(c.held_part.is_not(None)),
            "in_batches_forwarded": in_batches.where(b.status == "forwarded"),
            "in_batches_unforwarded": in_batches.where(b.status != "forwarded", ~refused),
            "in_batches_refused": in_batches.where(b.status != "forwarded", refused),
        }
        with self._snapshot() as conn:
            found = {"pending": sum(waiting_groups(conn, evaluated=False).values())}
            found |= {name: int(conn.execute(q).scalar_one() or 0) for name, q in queries.items()}
            query = select(g.status, func.sum(g.deleted)).group_by(g.status)
            groups = {str(status): int(n or 0) for status, n in conn.execute(query)}
            query = select(p.reason, func.sum(p.contributions)).group_by(p.reason)
            purges = {str(reason): int(n or 0) for reason, n in conn.execute(query)}
        found["deleted_by_algorithm_3"] = sum(groups.values())
        found["purged"] = sum(purges.values())
        causes = dict.fromkeys(LEDGER_CAUSES, 0)
        causes["abort"] = groups.pop(str(GroupStatus.ABORTED), 0)
        causes["randomized_deletion"] = sum(groups.values())
        for reason, n in purges.items():
            causes[reason] = causes.get(reason, 0) + n
        return found, causes

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[Connection]:
        """A connection whose reads all see one snapshot of the database (until it closes)."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql(self.snapshot_sql)
            yield conn

    def channel_health(self, epochs: int) -> list[EpochGroups]:
        """Per channel, its ``epochs`` newest epochs with an evaluated group, newest first:
        the groups released, held and aborted, and the contributions of the released groups
        alone; nothing of a group still waiting, nor the size of a held or aborted one
        (docs/protocol.md). Channels are whatever the ``groups`` rows name. Reads the ``groups``
        and ``batches`` rows (one per group), never a contribution's, in one snapshot, so a
        group and its batch are seen together.

        Raises:
            ValueError: ``epochs`` is below 1.
        """
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got epochs={epochs}")
        with self._snapshot() as conn:
            rows = conn.execute(newest_epochs(epochs)).all()
            forwarded = forwarded_by_epoch(conn, [(row.channel_id, int(row.epoch)) for row in rows])
        return [
            EpochGroups(
                channel_id=row.channel_id,
                epoch=int(row.epoch),
                released=int(row.released),
                held=int(row.held),
                aborted=int(row.aborted),
                received=int(row.received),
                deleted=int(row.deleted),
                batched=int(row.batched),
                forwarded=forwarded.get((row.channel_id, int(row.epoch)), 0),
            )
            for row in rows
        ]
