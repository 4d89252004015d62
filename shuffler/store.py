"""The contribution store: every SQL statement the shuffler runs, behind one interface.

:class:`ContributionStore` holds the dialect-neutral queries (SQLAlchemy Core over the tables of
:mod:`shuffler.tables`); :class:`SqliteContributionStore` and :class:`PostgresContributionStore`
supply what differs (the insert-ignore construct, the driver's placeholder, connection tuning).
:func:`make_store` picks one for an engine; nothing else in the shuffler looks at the dialect.

What it guarantees (docs/protocol.md, "Delivery guarantees"): a receipt only after its commit; a
group evaluated once, whole, with the write lock held only for a short final step; a part sent
by one forwarder at a time (a lease). The protocol and why it holds: docs/shuffler.md,
"Storage, locking and durability".
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from sqlalchemy import (
    Select,
    Table,
    case,
    delete,
    event,
    exists,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.dml import Insert

from common.terms import ChannelTerms
from common.wire import ChannelPolicy
from runtime import db
from runtime.conservation import LEDGER_CAUSES
from runtime.failpoints import failpoint
from shuffler import tables
from shuffler.batcher import Batcher, DealtBatch, Deletion, Evaluation, GroupStatus, ReleasedBatch
from shuffler.records import (
    Conflict,
    DuePart,
    EpochGroups,
    GroupKey,
    PartKey,
    Pending,
    SealedPart,
    pack_fragments,
)
from shuffler.uniqueness import HeldKeys, Key, writer_lock

_COLUMNS = (
    "channel_id",
    "crowd_id",
    "epoch",
    "client_id",
    "nonce",
    "fragments",
    "n_fragments",
    "received_at",
    "receipt",
)
_NONCE, _RECEIPT = _COLUMNS.index("nonce"), _COLUMNS.index("receipt")
_CLIENT = _COLUMNS.index("client_id")
_CHANNEL, _EPOCH = _COLUMNS.index("channel_id"), _COLUMNS.index("epoch")
_ROWS_PER_STATEMENT = 100  # 900 parameters: under SQLite's historical limit of 999
_PARAMETERS_PER_CHECK = 900  # a check statement's clients and channels together (same limit)
#: The key of a followed channel's stored row that says why it is suspended
#: (:class:`shuffler.policies.ChannelPolicies`: it takes no more contributions).
SUSPENDED_KEY = "suspended"
#: How long a close or revocation waits for the running inserts before it gives up (ingest
#: queues behind it meanwhile): :meth:`PostgresContributionStore._barrier`.
BARRIER_TIMEOUT_MS = 2_000
#: A connection held for inserts is used again without the pool's ping while it was used less
#: than this long ago (a busy writer); after that it goes back through the pool, which pings it.
HELD_IDLE_SECONDS = 1.0
_IDS_PER_DELETE = 10_000
#: How long a staged part may wait for its evaluation to commit before retention deletes it as
#: left behind by a crash (far above the 334 s an epoch of 10^6 contributions took to close).
STAGED_GRACE_SECONDS = 6 * 3600.0
UNSTAGE_ATTEMPTS = 5
#: Dead contributions (of evaluated groups) deleted per transaction by ``sweep``.
SWEEP_CHUNK = 2_000
#: Group keys looked up in the ``groups`` table per query.
_KEYS_PER_QUERY = 200
#: Rows of a group locked (and their ids and fragment counts read) per query.
_LOCK_PAGE = 50_000
#: Survivors whose packed fragments are read per query while dealing (~2 KB each for a
#: k-RAPPOR contribution of 30 fragments: a few MB per chunk, whatever the group's size).
_READ_ROWS = 2_000
#: Batch parts forwarded per round (bounds one round's time when the analyzer is slow).
FORWARD_ROUND = 32

Row = tuple[Any, ...]
Ids = npt.NDArray[np.int64]
#: What one group-commit transaction found: (revoked clients among the rows, latest closed
#: epoch of their channels, receipts of the rows that landed, nonces that were already taken).
Landings = tuple[set[str], dict[str, int], set[str], set[bytes]]

log = logging.getLogger("esa.shuffler")


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


@functools.lru_cache(maxsize=256)
def _insert_sql(mark: str, rows: int) -> str:
    """``INSERT INTO contributions (...) VALUES (...), ... ON CONFLICT DO NOTHING``."""
    values = "(" + ", ".join([mark] * len(_COLUMNS)) + ")"
    return (
        f"INSERT INTO {tables.contributions.name} ({', '.join(_COLUMNS)}) "
        f"VALUES {', '.join([values] * rows)} ON CONFLICT DO NOTHING"
    )


#: The group commit on PostgreSQL, one statement (so one transaction, in autocommit): the rows
#: as nine arrays in :data:`_COLUMNS` order; reads the revoked clients and the latest closed
#: epoch of each channel among them (``r``, ``e``), inserts the rows neither revoked nor late
#: and returns the receipts that landed (``i``). One snapshot for the reads and the insert.
_PG_INSERT = f"""
WITH v AS (
  SELECT * FROM unnest(%b::text[], %b::text[], %b::bigint[], %b::text[], %b::bytea[],
                       %b::bytea[], %b::integer[], %b::float8[], %b::text[])
    AS v({", ".join(_COLUMNS)})
), r AS (
  SELECT client_id FROM {tables.revoked.name} WHERE client_id IN (SELECT client_id FROM v)
), e AS (
  SELECT channel_id, max(epoch) AS epoch FROM {tables.closed_epochs.name}
  WHERE channel_id IN (SELECT channel_id FROM v) GROUP BY channel_id
), i AS (
  INSERT INTO {tables.contributions.name} ({", ".join(_COLUMNS)})
  SELECT {", ".join(_COLUMNS)} FROM v
  WHERE v.client_id NOT IN (SELECT client_id FROM r)
    AND v.epoch > COALESCE((SELECT e.epoch FROM e WHERE e.channel_id = v.channel_id), -1)
  ON CONFLICT DO NOTHING
  RETURNING receipt
)
SELECT 'r', client_id, NULL::bigint FROM r
UNION ALL SELECT 'e', channel_id, epoch FROM e
UNION ALL SELECT 'i', receipt, NULL::bigint FROM i
"""


def _insert_rows(cursor: Any, mark: str, rows: list[Row]) -> int:
    """Insert ``rows`` through a DB-API ``cursor`` (``mark``: its placeholder) in multi-row
    statements of up to :data:`_ROWS_PER_STATEMENT`; the rows inserted (both drivers count an
    ``INSERT``'s rows)."""
    inserted = 0
    for start in range(0, len(rows), _ROWS_PER_STATEMENT):
        chunk = rows[start : start + _ROWS_PER_STATEMENT]
        cursor.execute(
            _insert_sql(mark, len(chunk)), tuple(value for row in chunk for value in row)
        )
        inserted += cursor.rowcount
    return inserted


def _row(pending: Pending, receipt: str) -> Row:
    c = pending.contribution
    fragments = pack_fragments(c.fragments)
    return (c.channel_id, c.crowd_id, c.epoch, pending.client_id, c.nonce, fragments,
            len(c.fragments), pending.received_at, receipt)  # fmt: skip


def _group_filter(key: GroupKey, table: Table) -> list[Any]:
    return [
        table.c.channel_id == key.channel_id,
        table.c.crowd_id == key.crowd_id,
        table.c.epoch == key.epoch,
    ]


#: (kept contributions, their fragments) → the crowd the analyzer verifies for such a batch.
CrowdCheck = Callable[[int, int], int]


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
        rows = [_row(p, r) for p, r in zip(pending, receipts, strict=True)]
        revoked, closed, landed, taken = self._insert_checked(rows)
        return [_landing(row, landed, taken, revoked, closed) for row in rows]

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
            return _closed_among(conn)

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
        """The adopted channel policies (:class:`ChannelTerms` where a config stated the
        channel's privacy terms), the newest revision they were adopted at, and the suspended
        channels with why."""
        f = tables.followed_channels.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(f.policy, f.version)).all()
        policies, suspended = [], {}
        for text, _ in rows:
            stored = json.loads(text)
            why = stored.pop(SUSPENDED_KEY, None)
            policies.append(_followed_policy(stored))
            if why is not None:
                suspended[policies[-1].id] = str(why)
        return policies, max((int(version) for _, version in rows), default=0), suspended

    # --- batching -------------------------------------------------------------------------

    def open_groups(self) -> list[GroupKey]:
        """Every group with contributions awaiting evaluation (one short query per group:
        the batching round asks every second, while the table holds a whole epoch)."""
        with self.engine.connect() as conn:
            return _group_keys(conn, evaluated=False)

    def evaluate_group(
        self,
        key: GroupKey,
        batcher: Batcher,
        policy: ChannelPolicy,
        now: float,
        crowd: CrowdCheck | None = None,
    ) -> Evaluation | None:
        """Apply ESA-revisited Algorithm 3 to the group, whole, and store its outcome; the write
        lock is held only for the short final step, so ingest goes on while a big group is dealt.

        None when nothing waits in the group, when it was evaluated already, or when it changed
        meanwhile (evaluated again in a later round). The three steps and why they are safe:
        docs/shuffler.md, "Evaluating a group".

        ``crowd``: the crowd the analyzer will verify for (kept, fragments); a batch it would
        withhold below ``min_crowd`` is held here instead, as Algorithm 3 holds a small group.

        Raises:
            sqlalchemy.exc.IntegrityError: another worker recorded this group first.
        """
        with self.exclusive(key) as mine:
            if not mine:  # another replica is evaluating the group right now
                return None
            return self._evaluate(key, batcher, policy, now, crowd)

    @contextlib.contextmanager
    def exclusive(self, key: GroupKey) -> Iterator[bool]:
        """Whether this process may evaluate ``key`` now: always on SQLite (one process per
        database, its batching serialized); PostgreSQL overrides it with an advisory lock, so
        replicas do not deal the same group twice only for one of them to discard it."""
        yield True

    def _evaluate(
        self,
        key: GroupKey,
        batcher: Batcher,
        policy: ChannelPolicy,
        now: float,
        crowd: CrowdCheck | None,
    ) -> Evaluation | None:
        """:meth:`evaluate_group`'s three steps (the caller holds :meth:`exclusive`)."""
        with self.engine.connect() as conn:
            ids, sizes = _group_rows(conn, key, lock=False)
            evaluated = _evaluated(conn, key)
        if not ids.size or evaluated:  # an evaluated group's rows are dead, awaiting the sweep
            return None
        deletion = batcher.decide(int(ids.size), policy)
        batch = None
        if deletion.status is GroupStatus.RELEASED:
            picked = batcher.survivors(int(ids.size), deletion.kept)
            fragments = int(sizes[picked].sum())
            if crowd is not None and crowd(deletion.kept, fragments) < policy.min_crowd:
                deletion = Deletion(GroupStatus.HELD, deletion.n, 0)
            else:
                batch = self._stage(key, batcher, ids[picked], fragments, now)
                if batch is None:
                    return None
                failpoint("shuffler.close.after_parts_staged")
        try:
            outcome = self._finish(key, ids, deletion, batch, now)
        except BaseException:
            if batch is not None:
                self._unstage(batch.batch_id)
            raise
        if outcome is None and batch is not None:
            self._unstage(batch.batch_id)
        return outcome

    @abstractmethod
    def begin_writing(self, conn: Connection) -> None:
        """Start ``conn``'s transaction as a writer (before :meth:`evaluate_group`'s final
        step reads the group)."""

    def spill_directory(self) -> Path | None:
        """Where the streamed shuffle's temporary file goes (None: the system's)."""
        return None

    def packed(self, conn: Connection, key: GroupKey, survivors: Ids) -> Iterator[list[bytes]]:
        """The survivors' packed fragments, :data:`_READ_ROWS` contributions at a time, by
        ``IN`` lists of their ids (SQLite reads a row by its id in microseconds).

        Raises:
            _VanishedError: a survivor's row was deleted meanwhile (a retention purge).
        """
        c = tables.contributions.c
        for start in range(0, survivors.size, _READ_ROWS):
            chunk = survivors[start : start + _READ_ROWS].tolist()
            rows = conn.execute(select(c.fragments).where(c.id.in_(chunk))).scalars()
            blobs = [bytes(blob) for blob in rows]
            if len(blobs) != len(chunk):
                raise _VanishedError(f"{len(chunk) - len(blobs)} contributions vanished")
            yield blobs

    def _stage(
        self, key: GroupKey, batcher: Batcher, survivors: Ids, fragments: int, now: float
    ) -> ReleasedBatch | None:
        """Deal the survivors' fragments (read in chunks) and store every signed part
        ``staged``, one short transaction each; None (nothing left staged) when a survivor's
        row vanished meanwhile. Any failure deletes what was staged."""
        n, directory = int(survivors.size), self.spill_directory()
        try:
            with (
                self.engine.connect() as conn,
                batcher.release(
                    key, n, fragments, self.packed(conn, key, survivors), directory
                ) as release,
            ):
                conn.rollback()  # the survivors are dealt: end the read before staging
                self._store_staged(release, now)
        except _VanishedError:
            return None
        return release.batch

    def _store_staged(self, release: DealtBatch, now: float) -> None:
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
                stage = functools.partial(_stage_part, sealed=sealed, now=now)
                db.run_tx(self.engine, "shuffler.stage_part", stage, counted=False)
                parts += 1
            if parts != batch.parts:
                raise RuntimeError(
                    f"batch {batch.batch_id} announced {batch.parts} parts, made {parts}"
                )
        except BaseException:
            self._unstage(batch.batch_id)
            raise

    def _finish(
        self, key: GroupKey, ids: Ids, deletion: Deletion, batch: ReleasedBatch | None, now: float
    ) -> Evaluation | None:
        """Step 3 of :meth:`evaluate_group`, under the write lock: None when another worker
        evaluated the group first or a row read in step 1 vanished.

        Run once (``attempts=1``): Algorithm 3's draw (``deletion``) and the signed ``batch``
        were made before it, and a failure here unstages the batch and leaves the group to the
        next round, which draws afresh only if nothing committed (docs/shuffler.md, "Evaluating
        a group"); an ``IntegrityError`` (another worker recorded the group first) reaches the
        caller as before. Not counted: one per group evaluated, whatever its outcome."""

        def record(conn: Connection) -> bool:
            self.begin_writing(conn)
            part = _evaluated(conn, key)
            if part:
                return False
            current, _ = _group_rows(conn, key, lock=True)
            if np.setdiff1d(ids, current, assume_unique=True).size:
                return False
            _purge_late(conn, np.setdiff1d(current, ids, assume_unique=True), now)
            if batch is not None:
                _publish(conn, key, batch, now)
            _apply(conn, key, part, ids, deletion, now)
            failpoint("shuffler.close.group_before_commit")
            return True

        if not db.run_tx(self.engine, "shuffler.record_group", record, attempts=1, counted=False):
            return None
        failpoint("shuffler.close.group_after_commit")
        return Evaluation(deletion, batch)

    def _unstage(self, batch_id: str) -> None:
        """Delete a batch's staged parts (an evaluation that did not commit), trying a few
        times: the failure that stopped the evaluation may be a dropped connection. What a
        crash leaves behind, retention deletes (:data:`STAGED_GRACE_SECONDS`)."""
        p = tables.batch_parts.c
        # Any OperationalError (a dropped connection too), retried; not counted (per batch).
        db.run_tx(
            self.engine,
            "shuffler.unstage",
            lambda conn: _delete_parts(conn, p.batch_id == batch_id, p.status == "staged"),
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
            .where(p.status == "pending", p.next_attempt_at <= now, _unleased(now))
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
                .where(*_part_filter(key), p.status == "pending", _unleased(now))
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
                    .where(*_part_filter(key))
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
                .where(*_part_filter(key))
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
        query = update(tables.batch_parts).where(*_part_filter(key), pending).values(**changes)
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
        old = _expired(conn, cutoff)
        stale = _stale_batches(conn, cutoff, now)
        if stale:
            _lock_parts(conn, list(stale))
            stale = _stale_batches(conn, cutoff, now, among=list(stale))
        removed = {"retention": _delete_ids(conn, old), "refused": 0}
        if stale:
            ids = list(stale)
            _delete_parts(conn, tables.batch_parts.c.batch_id.in_(ids))
            conn.execute(delete(tables.batches).where(b.batch_id.in_(ids)))
        _delete_orphans(conn, now - STAGED_GRACE_SECONDS)
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
            dead = _group_keys(conn, evaluated=True)
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
        return _delete_ids(conn, _dead_ids(conn, key, SWEEP_CHUNK))

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
            found = {"pending": sum(_waiting_groups(conn, evaluated=False).values())}
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
            rows = conn.execute(_newest_epochs(epochs)).all()
            forwarded = _forwarded(conn, [(row.channel_id, int(row.epoch)) for row in rows])
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


def _stage_part(conn: Connection, sealed: SealedPart, now: float) -> None:
    """Insert one signed part ``staged``, with its body (:meth:`ContributionStore._stage`)."""
    conn.execute(insert(tables.batch_parts).values(**_part_row(sealed, now)))
    conn.execute(
        insert(tables.part_bodies).values(
            batch_id=sealed.batch_id, part=sealed.part, body=sealed.body
        )
    )


def _stale_batches(
    conn: Connection, cutoff: float, now: float, among: list[str] | None = None
) -> dict[str, tuple[int, bool]]:
    """Undelivered batches created before ``cutoff`` with no part leased and, unless the
    analyzer refused one of their parts, none delivered, as ``{batch_id: (n_contributions,
    refused)}`` (only those in ``among`` when given)."""
    b, p = tables.batches.c, tables.batch_parts.c
    refused = exists().where(p.batch_id == b.batch_id, p.status == "failed")
    leased = exists().where(p.batch_id == b.batch_id, p.lease_until >= now)
    delivered = exists().where(p.batch_id == b.batch_id, p.status == "forwarded")
    query = select(b.batch_id, b.n_contributions, refused).where(
        b.status != "forwarded", b.created_at < cutoff, ~leased, or_(refused, ~delivered)
    )
    if among is not None:
        query = query.where(b.batch_id.in_(among))
    return {str(batch_id): (int(n), bool(r)) for batch_id, n, r in conn.execute(query)}


def _lock_parts(conn: Connection, batch_ids: list[str]) -> None:
    """Lock every part of these batches until the transaction ends (PostgreSQL)."""
    p = tables.batch_parts.c
    conn.execute(select(p.batch_id).where(p.batch_id.in_(batch_ids)).with_for_update()).all()


def _delete_orphans(conn: Connection, before: float) -> None:
    """Delete staged parts older than ``before`` (an evaluation that crashed mid-staging)."""
    p = tables.batch_parts.c
    _delete_parts(conn, p.status == "staged", p.created_at < before)


def _delete_parts(conn: Connection, *where: Any) -> None:
    """Delete the parts matching ``where`` (conditions on ``batch_parts``) and their bodies."""
    p, body = tables.batch_parts.c, tables.part_bodies.c
    matching = exists().where(p.batch_id == body.batch_id, p.part == body.part, *where)
    conn.execute(delete(tables.part_bodies).where(matching))
    conn.execute(delete(tables.batch_parts).where(*where))


#: The keys of the stored rows of epochs still open, for :class:`HeldKeys`.
_OPEN_KEYS_SQL = (
    f"SELECT c.channel_id, c.epoch, c.client_id, c.nonce FROM {tables.contributions.name} c "
    f"WHERE c.epoch > COALESCE((SELECT max(e.epoch) FROM {tables.closed_epochs.name} e "
    "WHERE e.channel_id = c.channel_id), -1)"
)


def _key(row: Row) -> Key:
    """What the replay and quota checks read of a row."""
    return Key(row[_CHANNEL], row[_EPOCH], row[_CLIENT], row[_NONCE])


def _landing(
    row: Row, landed: set[str], taken: set[bytes], revoked: set[str], closed: dict[str, int]
) -> str | Conflict:
    if row[_CLIENT] in revoked:
        return Conflict.REVOKED
    if _late(row, closed):
        return Conflict.CLOSED
    if row[_RECEIPT] in landed:
        return str(row[_RECEIPT])
    return Conflict.REPLAYED_NONCE if row[_NONCE] in taken else Conflict.OVER_QUOTA


def _pg_landings(found: Sequence[Row]) -> Landings:
    """What :data:`_PG_INSERT` returned, as (revoked, closed, landed, no nonces known yet)."""
    revoked, closed = _checks(found)
    return revoked, closed, {str(value) for kind, value, _ in found if kind == "i"}, set()


def _checks(found: Sequence[Row]) -> tuple[set[str], dict[str, int]]:
    """The revoked clients (rows ``('r', client, _)``) and the latest closed epoch of each
    channel (rows ``('e', channel, epoch)``) among what a check statement returned."""
    revoked = {str(value) for kind, value, _ in found if kind == "r"}
    closed = {str(value): int(epoch) for kind, value, epoch in found if kind == "e"}
    return revoked, closed


@functools.lru_cache(maxsize=256)
def _checks_sql(mark: str, clients: int, channels: int) -> str:
    """The revoked clients among ``clients`` ids and the latest closed epoch of each of
    ``channels`` channels, in one statement whose text depends only on the counts."""
    return (
        f"SELECT 'r', client_id, NULL FROM {tables.revoked.name} "
        f"WHERE client_id IN ({', '.join([mark] * clients)}) "
        f"UNION ALL SELECT 'e', channel_id, max(epoch) FROM {tables.closed_epochs.name} "
        f"WHERE channel_id IN ({', '.join([mark] * channels)}) GROUP BY channel_id"
    )


def _checks_among(
    cursor: Any, mark: str, clients: set[str], channels: set[str]
) -> tuple[set[str], dict[str, int]]:
    """Which of ``clients`` are revoked and the latest closed epoch of each of ``channels``,
    read in the insert's transaction (SQLite; PostgreSQL reads them in the insert statement
    itself, :data:`_PG_INSERT`): a replica of the same trust domain may have revoked a client
    or closed an epoch since this process loaded them, and what any replica answered must hold
    at every replica from then on. One statement per :data:`_PARAMETERS_PER_CHECK`
    parameters (the channels, then as many clients as fit),
    written once per pair of counts and sent as is: two SQLAlchemy queries with expanding
    ``IN`` lists cost several µs per row at the batch sizes of a loaded replica
    (docs/benchmarks.md, "Ingest CPU per contribution")."""
    names, revoked, closed = sorted(clients), set[str](), dict[str, int]()
    per = max(1, _PARAMETERS_PER_CHECK - len(channels))
    for start in range(0, max(len(names), 1), per):  # once with no clients
        chunk = names[start : start + per]
        sql = _checks_sql(mark, len(chunk), len(channels))
        found, closed = _checks(cursor.execute(sql, (*chunk, *channels)).fetchall())
        revoked |= found
    return revoked, closed


def _nonces_among(conn: Connection, nonces: list[bytes]) -> set[bytes]:
    """Which of ``nonces`` are stored (after the insert committed: a nonce it hit is in the
    table, or in an evaluated group's batch since, and then reads as over quota; both 409)."""
    c = tables.contributions.c
    return set(conn.execute(select(c.nonce).where(c.nonce.in_(nonces))).scalars())


def _closed_among(conn: Connection) -> dict[str, int]:
    """The latest closed epoch of each channel. An admin close answered by one replica of the
    trust domain persists it, and from then on no replica may acknowledge a contribution for
    that epoch (the group is evaluated once; a later one would only be deleted as late, after
    its 202): the insert reads it in its own transaction (:func:`_checks_among`)."""
    e = tables.closed_epochs.c
    query = select(e.channel_id, func.max(e.epoch)).group_by(e.channel_id)
    return {channel: int(epoch) for channel, epoch in conn.execute(query)}


def _late(row: Row, closed: dict[str, int]) -> bool:
    return bool(row[_EPOCH] <= closed.get(row[_CHANNEL], -1))


def _admitted(rows: list[Row], revoked: set[str], closed: dict[str, int]) -> list[Row]:
    """The rows neither from a revoked client nor for a closed epoch."""
    return [row for row in rows if row[_CLIENT] not in revoked and not _late(row, closed)]


def _refused_nonces(
    rows: list[Row], revoked: set[str], closed: dict[str, int], landed: set[str]
) -> list[bytes]:
    """The nonces of the admitted rows that did not land: a unique constraint refused them."""
    return [r[_NONCE] for r in _admitted(rows, revoked, closed) if r[_RECEIPT] not in landed]


def _evaluated_among(conn: Connection, keys: Collection[GroupKey]) -> set[GroupKey]:
    """The groups among ``keys`` that were evaluated (looked up by the primary key)."""
    g = tables.groups.c
    wanted, found = list(keys), set()
    for start in range(0, len(wanted), _KEYS_PER_QUERY):
        chunk = [
            (k.channel_id, k.crowd_id, k.epoch) for k in wanted[start : start + _KEYS_PER_QUERY]
        ]
        query = (
            select(g.channel_id, g.crowd_id, g.epoch)
            .where(tuple_(g.channel_id, g.crowd_id, g.epoch).in_(chunk))
            .distinct()
        )
        found |= {GroupKey(ch, cr, int(ep)) for ch, cr, ep in conn.execute(query)}
    return found


def _waiting_groups(conn: Connection, evaluated: bool) -> dict[GroupKey, int]:
    """Groups with contributions not held, and how many: those awaiting evaluation
    (``evaluated`` False) or the dead rows of groups evaluated already (True). The counts
    come from the group index alone; the ``groups`` table is small."""
    c = tables.contributions.c
    query = (
        select(c.channel_id, c.crowd_id, c.epoch, func.count())
        .where(c.held_part.is_(None))
        .group_by(c.channel_id, c.crowd_id, c.epoch)
    )
    counts = {GroupKey(ch, cr, int(ep)): int(n) for ch, cr, ep, n in conn.execute(query)}
    done = _evaluated_among(conn, counts)
    return {key: n for key, n in counts.items() if (key in done) == evaluated}


def _group_keys(conn: Connection, evaluated: bool) -> list[GroupKey]:
    """The groups of :func:`_waiting_groups` without their counts, found by skipping through
    the group index from one group to the next (a query per group) instead of counting every
    row of the table."""
    c = tables.contributions.c
    columns = (c.channel_id, c.crowd_id, c.epoch)
    first = select(*columns).where(c.held_part.is_(None)).order_by(*columns).limit(1)
    keys: list[GroupKey] = []
    query = first
    while (row := conn.execute(query).first()) is not None:
        keys.append(GroupKey(row[0], row[1], int(row[2])))
        after = tuple_(row[0], row[1], row[2], types=[column.type for column in columns])
        query = first.where(tuple_(*columns) > after)
    done = _evaluated_among(conn, keys)
    return [key for key in keys if (key in done) == evaluated]


def _unheld(key: GroupKey) -> list[Any]:
    """The group's contributions that are not held: waiting, or dead once it is evaluated."""
    return [*_group_filter(key, tables.contributions), tables.contributions.c.held_part.is_(None)]


def _dead_ids(conn: Connection, key: GroupKey, limit: int) -> list[int]:
    query = select(tables.contributions.c.id).where(*_unheld(key)).limit(limit)
    return list(conn.execute(query).scalars())


def _expired(conn: Connection, cutoff: float) -> list[int]:
    """Contributions received before ``cutoff`` that retention deletes: waiting or held ones,
    not the dead rows of evaluated groups (their group counts them; the sweep deletes them).
    The rows are locked first (``FOR UPDATE``; SQLite's writer lock) and the groups read
    after: an evaluation that locked them commits first and its group is seen, or waits and
    finds them gone."""
    c = tables.contributions.c
    query = select(c.id, c.channel_id, c.crowd_id, c.epoch, c.held_part).where(
        c.received_at < cutoff
    )
    rows = conn.execute(query.with_for_update()).all()
    done = _evaluated_among(conn, {GroupKey(r[1], r[2], int(r[3])) for r in rows})
    return [
        int(row_id)
        for row_id, channel, crowd, epoch, held in rows
        if held is not None or GroupKey(channel, crowd, int(epoch)) not in done
    ]


def _group_rows(conn: Connection, key: GroupKey, lock: bool) -> tuple[Ids, Ids]:
    """The group's waiting contributions as (ids, fragment counts) in id order, blobs unread;
    with ``lock`` every row is locked until the transaction ends (``FOR UPDATE``; SQLite
    compiles it away, its writer already holds the database). Pages by id until one comes back
    empty: PostgreSQL may return a short page when a row it waited for was deleted meanwhile."""
    c = tables.contributions.c
    ids: list[Ids] = []
    sizes: list[Ids] = []
    last = -1
    while True:
        query = (
            select(c.id, c.n_fragments)
            .where(*_unheld(key), c.id > last)
            .order_by(c.id)
            .limit(_LOCK_PAGE)
        )
        rows = _integer_rows(conn, query.with_for_update() if lock else query)
        if not rows.size:
            break
        ids.append(rows[:, 0])
        sizes.append(rows[:, 1])
        last = int(rows[-1, 0])
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate(ids) if ids else empty, np.concatenate(sizes) if sizes else empty


def _integer_rows(conn: Connection, query: Select[Any]) -> npt.NDArray[np.int64]:
    """A query of integer columns as a 2-D array, its rows fetched from the driver's cursor:
    SQLAlchemy's row objects cost four times the CPU for the ~10^5 rows of a closing group
    (py-spy: a third of a shuffler's busy samples while closing a 10^6-device epoch)."""
    result = conn.execute(query)
    try:
        rows = result.cursor.fetchall()
        return np.array(rows, dtype=np.int64).reshape(-1, len(query.selected_columns))
    finally:
        result.close()


def _purge_late(conn: Connection, ids: Ids, now: float) -> None:
    """Delete contributions that reached an already evaluated group, and record them."""
    removed = _delete_ids(conn, ids.tolist())
    if removed:
        conn.execute(
            insert(tables.purges).values(reason="late", contributions=removed, purged_at=now)
        )


class _VanishedError(RuntimeError):
    """A contribution read when the evaluation began was deleted before its blob was read."""


def _evaluated(conn: Connection, key: GroupKey) -> int:
    """How many times the group was evaluated (0 or 1: a group is evaluated once, whole)."""
    g = tables.groups
    return int(
        conn.execute(select(func.count()).select_from(g).where(*_group_filter(key, g))).scalar_one()
    )


def _apply(
    conn: Connection, key: GroupKey, part: int, ids: Ids, deletion: Deletion, now: float
) -> None:
    """Store Algorithm 3's outcome: hold the group's contributions, or record the group, whose
    row makes its contributions dead (the survivors' fragments are in the batch already
    stored; the sweep deletes the rows, :meth:`ContributionStore.sweep`)."""
    c = tables.contributions.c
    if deletion.status is GroupStatus.HELD:
        for start in range(0, ids.size, _IDS_PER_DELETE):
            chunk = ids[start : start + _IDS_PER_DELETE].tolist()
            conn.execute(update(tables.contributions).where(c.id.in_(chunk)).values(held_part=part))
    conn.execute(
        insert(tables.groups).values(
            channel_id=key.channel_id,
            crowd_id=key.crowd_id,
            epoch=key.epoch,
            part=part,
            status=str(deletion.status),
            n=deletion.n,
            kept=deletion.kept,
            deleted=deletion.deleted,
            evaluated_at=now,
        )
    )


def _part_row(sealed: SealedPart, now: float) -> dict[str, Any]:
    """A signed part as a ``batch_parts`` row, ``staged`` until its group's outcome commits."""
    return {
        "batch_id": sealed.batch_id,
        "part": sealed.part,
        "signature": sealed.signature,
        "status": "staged",
        "created_at": now,
        "attempts": 0,
        "next_attempt_at": now,
    }


def _publish(conn: Connection, key: GroupKey, batch: ReleasedBatch, now: float) -> None:
    """Turn the batch's staged parts ``pending`` (forwarders may send them) and record it.

    Raises:
        RuntimeError: the staged parts are not the parts the batch announced.
    """
    p = tables.batch_parts.c
    ready = conn.execute(
        update(tables.batch_parts)
        .where(p.batch_id == batch.batch_id, p.status == "staged")
        .values(status="pending", next_attempt_at=now)
    ).rowcount
    if ready != batch.parts:
        raise RuntimeError(f"batch {batch.batch_id} has {ready} of its {batch.parts} parts")
    conn.execute(
        insert(tables.batches).values(
            batch_id=batch.batch_id,
            channel_id=key.channel_id,
            epoch=key.epoch,
            n_contributions=batch.n_contributions,
            parts=batch.parts,
            status="pending",
            created_at=now,
        )
    )


def _part_filter(key: PartKey) -> list[Any]:
    p = tables.batch_parts.c
    return [p.batch_id == key.batch_id, p.part == key.part]


def _unleased(now: float) -> Any:
    lease = tables.batch_parts.c.lease_until
    return or_(lease.is_(None), lease < now)


def _delete_ids(conn: Connection, ids: Sequence[int]) -> int:
    """Delete contributions by id; how many rows were there to delete (a row another
    transaction removed first is not counted twice)."""
    deleted = 0
    for start in range(0, len(ids), _IDS_PER_DELETE):
        chunk = ids[start : start + _IDS_PER_DELETE]
        result = conn.execute(
            delete(tables.contributions).where(tables.contributions.c.id.in_(chunk))
        )
        deleted += result.rowcount
    return deleted


#: SQLite write-ahead-log pages between checkpoints (SQLite's default is 1,000).
WAL_AUTOCHECKPOINT_PAGES = 10_000


def _checkpoint_interval(dbapi_connection: Any, _: Any) -> None:
    """Checkpoint the SQLite write-ahead log every 10,000 pages (~40 MB) instead of 1,000.

    A checkpoint copies each page once however often it changed since the last one, so
    checkpointing less often writes less (it mattered most while ingest touched random pages
    of the nonce and quota indexes, which SQLite has not had since migration 0007). Durability
    is unchanged: a commit is on disk (in the log) when it returns.
    """
    dbapi_connection.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")


class SqliteContributionStore(ContributionStore):
    """SQLite (one file, write-ahead log, one writing process): ``?`` placeholders, less
    frequent checkpoints, the replay and quota checks in memory (:mod:`shuffler.uniqueness`)."""

    mark = "?"
    #: Deferred: the snapshot is taken at the first read (WAL) and kept to the end.
    snapshot_sql = "BEGIN"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        event.listen(engine, "connect", _checkpoint_interval)
        self._held: HeldKeys | None = None
        self._writer: int | None = None
        self._writer_connection: PoolProxiedConnection | None = None
        self._writing = threading.Lock()

    def _insert_checked(self, rows: list[Row]) -> Landings:
        """One transaction: read which clients are revoked and which epochs closed, insert the
        rows neither from those nor replaying a nonce or over the quota (the held keys, checked
        and then added under the writing lock, so two inserts of this process never interleave
        between them). One multi-row ``INSERT`` per (up to) 100 rows, written once per row
        count and sent as is, on the writer's own connection (:meth:`_writer_transaction`).

        Raises:
            SecondWriterError: another process writes to this file (at the first insert).
            sqlalchemy.exc.OperationalError: the transaction failed (nothing stored).
        """
        if not rows:
            return set(), {}, set(), set()
        with self._writing:
            held = self._held_keys()
            with self._writer_transaction() as cursor:
                revoked, closed = _checks_among(
                    cursor, self.mark, {r[_CLIENT] for r in rows}, {r[_CHANNEL] for r in rows}
                )
                held.forget_closed(closed)
                kept = _admitted(rows, revoked, closed)
                fresh, replayed = held.sort([_key(row) for row in kept])
                new = [kept[index] for index in fresh]
                if _insert_rows(cursor, self.mark, new) != len(new):  # only a receipt collides
                    raise sqlite3.IntegrityError("a receipt collided: nothing was stored")
            held.add(_key(row) for row in new)
        return revoked, closed, {row[_RECEIPT] for row in new}, replayed

    @contextlib.contextmanager
    def _writer_transaction(self) -> Iterator[Any]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` through the driver's cursor on the one connection
        this process keeps for its group commits (used under the writing lock only): a pool
        check-out, its reset and SQLAlchemy's execution machinery cost ~70 CPU-µs a
        transaction (a one-row one: 209 → 142; docs/benchmarks.md, "SQLite group commit: CPU
        per transaction"). Rolled back on any failure; a connection that cannot roll back is
        dropped for a new one. Driver errors come out as SQLAlchemy's, like every query's.
        The ``COMMIT`` is the last thing that can fail: the caller holds the keys after it.

        Raises:
            sqlalchemy.exc.OperationalError: the transaction failed (nothing stored).
        """
        if self._writer_connection is None:
            self._writer_connection = self.engine.raw_connection()
        connection = self._writer_connection
        try:
            cursor = connection.cursor()
            try:
                cursor.execute("BEGIN IMMEDIATE")  # the write lock before the reads
                yield cursor
            finally:
                cursor.close()
            connection.commit()
        except BaseException as error:
            self._roll_back(connection)
            if isinstance(error, sqlite3.Error):  # its message has no parameters in it
                raise OperationalError("group commit", None, error) from error
            raise

    def _roll_back(self, connection: PoolProxiedConnection) -> None:
        """End a failed transaction; if even that fails, drop the connection for a new one."""
        try:
            connection.rollback()
        except sqlite3.Error:
            connection.invalidate()
            self._writer_connection = None

    def claim_file(self) -> None:
        """Take the file's writer lock (:func:`~shuffler.uniqueness.writer_lock`, on a lock
        file beside the database), so a second server on the same file stops before it
        migrates or writes anything.

        Raises:
            SecondWriterError: another process writes to this file.
        """
        with self._writing:
            self._lock_file()

    def start_writing(self) -> None:
        """Take the file's writer lock and read the held keys now, so a second server on the
        same file stops at its start, not at its first contribution; then release every
        forwarding lease: with the file's lock, any lease is a dead process's (a crash
        between a part's claim and its outcome), and the part would otherwise wait out
        ``forward_lease_seconds`` (two minutes by default) before it is sent again.

        Raises:
            SecondWriterError: another process writes to this file.
        """
        with self._writing:
            self._held_keys()
        p = tables.batch_parts.c
        query = (
            update(tables.batch_parts).where(p.lease_until.is_not(None)).values(lease_until=None)
        )
        db.run_tx(self.engine, "shuffler.release_leases", lambda conn: conn.execute(query))

    def _held_keys(self) -> HeldKeys:
        """The keys of the open epochs' rows, read from the table once (at
        :meth:`start_writing`, else at the first insert), after taking the file's writer lock,
        so no other process adds rows meanwhile."""
        if self._held is None:
            self._lock_file()
            held = HeldKeys()
            with self.engine.connect() as conn:
                held.add(Key(*row) for row in conn.exec_driver_sql(_OPEN_KEYS_SQL))
            self._held = held
        return self._held

    def _lock_file(self) -> None:
        """Take the writer lock once (a file database only: ``:memory:`` is this process's)."""
        database = self.engine.url.database
        if self._writer is None and database and database != ":memory:":
            self._writer = writer_lock(database)

    def close_epoch(self, channel_id: str, epoch: int, now: float) -> None:
        """Persist the close, then drop the keys of the epochs it closed (no insert admits a
        contribution for them any more: each reads the closed epochs in its transaction)."""
        super().close_epoch(channel_id, epoch, now)
        with self._writing:
            if self._held is not None:
                self._held.forget_closed({channel_id: epoch})

    def close(self) -> None:
        """Let go of the held keys and the writer lock (a store opened later reads them
        again)."""
        with self._writing:
            self._held = None
            if self._writer_connection is not None:
                self._writer_connection.close()
                self._writer_connection = None
            if self._writer is not None:
                os.close(self._writer)
                self._writer = None

    def insert_ignore(self, table: Table) -> Insert:
        return sqlite_insert(table).on_conflict_do_nothing()

    def begin_writing(self, conn: Connection) -> None:
        """``BEGIN IMMEDIATE``: the write lock from the first read on (the driver would only
        begin at the first write, after the group was read), so no other writer, a retention
        purge included, changes the group between its reading and its removal."""
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def spill_directory(self) -> Path | None:
        """Beside the database file (the shuffler's data directory), else the system's."""
        database = self.engine.url.database
        return Path(database).resolve().parent if database and database != ":memory:" else None


class PostgresContributionStore(ContributionStore):
    """PostgreSQL (psycopg): ``%s`` placeholders; the group commit is one statement
    (:data:`_PG_INSERT`, its array parameters in the binary format: ``%b``) on a connection
    the writer keeps while it is busy."""

    mark = "%s"
    #: The first statement of the transaction the driver began (read committed would give each
    #: statement its own snapshot).
    snapshot_sql = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._held: tuple[Connection, float] | None = None
        self._held_lock = threading.Lock()

    def _insert_checked(self, rows: list[Row]) -> Landings:
        """One statement, so one transaction in one round trip (autocommit): it reads the
        revoked clients and closed epochs among the rows, inserts the others and returns what
        it read and the receipts that landed (:data:`_PG_INSERT`). Its nine array parameters
        make it one prepared statement whatever the batch size; per transaction this replaced
        a pool check-out with its ping, ``BEGIN``, two reads, the insert and ``COMMIT``, which
        cost more than the rows themselves at the batch sizes of a loaded replica. Only when a
        unique constraint refused rows does a second statement, on the same connection, look
        up which nonces were taken; if that fails the rows that landed keep their receipts
        (the others are conflicts either way)."""
        if not rows:
            return set(), {}, set(), set()
        columns = tuple(list(column) for column in zip(*rows, strict=True))
        landings: Landings | None = None
        try:
            with self._autocommit() as conn:
                landings = _pg_landings(conn.exec_driver_sql(_PG_INSERT, columns).all())
                revoked, closed, landed, _ = landings
                missing = _refused_nonces(rows, revoked, closed, landed)
                if missing:  # a unique constraint refused these (rare: a replay, or over quota)
                    landings = (revoked, closed, landed, _nonces_among(conn, missing))
        except SQLAlchemyError as error:
            if landings is None:
                raise  # the statement did not commit: nothing stored
            # It committed; only which constraint each refused row hit is unknown (both 409).
            log.warning("conflict look-up failed", extra={"error": type(error).__name__})
        return landings

    def revoke(self, client_id: str, now: float) -> None:
        """Persist a revocation, then wait for the inserts already running (:meth:`_barrier`)."""
        super().revoke(client_id, now)
        self._barrier()

    def close_epoch(self, channel_id: str, epoch: int, now: float) -> None:
        """Persist the close, then wait for the inserts already running (:meth:`_barrier`)
        before the caller evaluates the group."""
        super().close_epoch(channel_id, epoch, now)
        self._barrier()

    def _barrier(self) -> None:
        """Wait until every insert that may have read the revocations and closed epochs before
        the last change committed has ended, at any replica: ``SHARE`` mode conflicts with the
        ``ROW EXCLUSIVE`` lock each insert holds to its end, and an insert that asks for it
        afterwards reads the change (its snapshot is taken after its locks). Without it, an
        insert that read the epoch open but was slow to finish (waiting on another replica's
        row with the same nonce) committed after the group's evaluation: acknowledged, then
        purged as late. While it waits, new inserts queue behind it; so it gives up after
        :data:`BARRIER_TIMEOUT_MS` (a vacuum or a long transaction holds a conflicting lock):
        the close stays persisted, the caller answers 503 or retries the evaluation next round.

        Raises:
            sqlalchemy.exc.OperationalError: the lock was not granted in time.
        """

        def wait(conn: Connection) -> None:
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{BARRIER_TIMEOUT_MS}ms'")
            conn.exec_driver_sql(f"LOCK TABLE {tables.contributions.name} IN SHARE MODE")

        db.run_tx(self.engine, "shuffler.barrier", wait, counted=False)

    @contextlib.contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        """An autocommit connection: the one the last insert used if it is free and was used
        less than :data:`HELD_IDLE_SECONDS` ago (no pool check-out, no ping), else one from the
        pool (pinged). Given back to be held only after a success: a connection that failed
        returns to the pool, which tests it before anyone uses it again."""
        with self._held_lock:
            held, self._held = self._held, None
        conn = held[0] if held and time.monotonic() - held[1] < HELD_IDLE_SECONDS else None
        if held and conn is None:
            held[0].close()
        if conn is None:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._held_lock:
            if self._held is None:
                self._held, conn = (conn, time.monotonic()), None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Give back the connection held for inserts (before the engine is disposed)."""
        with self._held_lock:
            held, self._held = self._held, None
        if held:
            held[0].close()

    def insert_ignore(self, table: Table) -> Insert:
        return pg_insert(table).on_conflict_do_nothing()

    def packed(self, conn: Connection, key: GroupKey, survivors: Ids) -> Iterator[list[bytes]]:
        """The survivors' packed fragments in one pass of a server-side cursor over the
        group's rows (the few deleted by Algorithm 3 and any that arrived late are skipped):
        one statement instead of a round trip and an index probe per id chunk.

        Raises:
            _VanishedError: a survivor's row was deleted meanwhile (a retention purge).
        """
        c = tables.contributions.c
        wanted = np.sort(survivors)
        if not wanted.size:
            return
        query = db.binary_rows(select(c.id, c.fragments).where(*_unheld(key)))
        streamed = conn.execution_options(stream_results=True, max_row_buffer=_READ_ROWS)
        found = 0
        for rows in streamed.execute(query).partitions(_READ_ROWS):
            ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
            at = np.minimum(np.searchsorted(wanted, ids), wanted.size - 1)
            keep = wanted[at] == ids
            found += int(keep.sum())
            yield [bytes(row[1]) for row, kept in zip(rows, keep, strict=True) if kept]
        if found != wanted.size:
            raise _VanishedError(f"{wanted.size - found} contributions vanished")

    @contextlib.contextmanager
    def exclusive(self, key: GroupKey) -> Iterator[bool]:
        """``pg_try_advisory_lock`` on the group's key, on a dedicated connection held for the
        whole evaluation: a replica that does not get it skips the group this round instead
        of dealing it in vain (correctness does not rest on it: the group's row locks and the
        ``groups`` primary key let one evaluation commit). A session lock, not a transaction
        one, because the evaluation commits several transactions; a replica killed mid-way
        loses its connection and with it the lock, so another replica takes the group over.
        """
        with db.try_advisory_lock(self.engine, group_lock_identity(key)) as mine:
            yield mine

    def begin_writing(self, conn: Connection) -> None:
        """Nothing: :meth:`evaluate_group` locks the group's rows (``FOR UPDATE``) as it reads
        them, which blocks a purge's ``DELETE`` of them until the evaluation commits."""


def group_lock_identity(key: GroupKey) -> list[object]:
    """What a group's PostgreSQL advisory lock is keyed on (:func:`db.lock_key`)."""
    return ["shuffler-group", key.channel_id, key.crowd_id, key.epoch]


STORES: dict[str, type[ContributionStore]] = {
    "sqlite": SqliteContributionStore,
    "postgresql": PostgresContributionStore,
}


def make_store(engine: Engine) -> ContributionStore:
    """The store implementation for ``engine``'s dialect.

    Raises:
        ValueError: for a database the shuffler does not support.
    """
    store = STORES.get(engine.dialect.name)
    if store is None:
        raise ValueError(
            f"unsupported database {engine.dialect.name!r}; use one of {sorted(STORES)}"
        )
    return store(engine)


def _newest_epochs(epochs: int) -> Select[Any]:
    """One row per (channel, epoch) among each channel's ``epochs`` newest evaluated epochs:
    groups by outcome, and ``n``, ``deleted`` and ``kept`` summed over the released groups
    only (the sizes of the others are secret)."""
    g = tables.groups.c
    released = g.status == str(GroupStatus.RELEASED)

    def groups_with(status: GroupStatus) -> Any:
        return func.sum(case((g.status == str(status), 1), else_=0))

    def over_released(column: Any) -> Any:
        return func.sum(case((released, column), else_=0))

    newest = func.row_number().over(partition_by=g.channel_id, order_by=g.epoch.desc())
    per_epoch = (
        select(
            g.channel_id,
            g.epoch,
            groups_with(GroupStatus.RELEASED).label("released"),
            groups_with(GroupStatus.HELD).label("held"),
            groups_with(GroupStatus.ABORTED).label("aborted"),
            over_released(g.n).label("received"),
            over_released(g.deleted).label("deleted"),
            over_released(g.kept).label("batched"),
            newest.label("newest"),
        )
        .group_by(g.channel_id, g.epoch)
        .subquery()
    )
    s = per_epoch.c
    return (
        select(
            s.channel_id, s.epoch, s.released, s.held, s.aborted, s.received, s.deleted, s.batched
        )
        .where(s.newest <= epochs)
        .order_by(s.channel_id, s.epoch.desc())
    )


def _forwarded(conn: Connection, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Contributions in batches every part of which the analyzer acknowledged, per (channel,
    epoch) of ``keys``."""
    b = tables.batches.c
    found: dict[tuple[str, int], int] = {}
    for start in range(0, len(keys), _KEYS_PER_QUERY):
        query = (
            select(b.channel_id, b.epoch, func.sum(b.n_contributions))
            .where(
                b.status == "forwarded",
                tuple_(b.channel_id, b.epoch).in_(keys[start : start + _KEYS_PER_QUERY]),
            )
            .group_by(b.channel_id, b.epoch)
        )
        found |= {(channel, int(epoch)): int(n) for channel, epoch, n in conn.execute(query)}
    return found


def _followed_policy(stored: dict[str, Any]) -> ChannelPolicy:
    """A followed channel's row: whole privacy terms when it names a mechanism."""
    kind = ChannelTerms if "mechanism" in stored else ChannelPolicy
    return kind.model_validate(stored)
