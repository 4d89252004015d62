"""The contribution store: every SQL statement the shuffler runs, behind one interface.

:class:`ContributionStore` holds the dialect-neutral queries (SQLAlchemy Core over the tables of
:mod:`shuffler.storage`); :class:`SqliteContributionStore` and :class:`PostgresContributionStore`
supply what differs (the insert-ignore construct, the driver's placeholder, connection tuning).
:func:`make_store` picks one for an engine; nothing else in the shuffler looks at the dialect.

Durability (PROTOCOL.md, "Delivery guarantees"): :meth:`~ContributionStore.insert` returns
receipts only after its transaction committed; :meth:`~ContributionStore.evaluate_group` stores a
group's batch (all its signed parts) in the same transaction that removes its contributions and
records the group as evaluated, whose primary key lets exactly one evaluation commit across
workers. A part is sent by exactly one forwarder at a time: :meth:`~ContributionStore.claim`
takes its lease with one conditional ``UPDATE`` (atomic in SQLite and PostgreSQL alike).
"""

from __future__ import annotations

import functools
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from sqlalchemy import Table, delete, event, exists, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import Insert

from shuffler import storage
from shuffler.batcher import Evaluation, GroupStatus
from shuffler.records import (
    Conflict,
    DuePart,
    GroupKey,
    PartKey,
    Pending,
    SealedPart,
    ShuffledBatch,
    pack_fragments,
)

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
_ROWS_PER_STATEMENT = 100  # 900 parameters: under SQLite's historical limit of 999
_IDS_PER_DELETE = 10_000
#: Batch parts forwarded per round (bounds one round's time when the analyzer is slow).
FORWARD_ROUND = 32

Row = tuple[Any, ...]
Seal = Callable[[ShuffledBatch], Iterable[SealedPart]]


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
        f"INSERT INTO {storage.contributions.name} ({', '.join(_COLUMNS)}) "
        f"VALUES {', '.join([values] * rows)} ON CONFLICT DO NOTHING"
    )


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


class ContributionStore(ABC):
    """Contributions, groups, batches, purges, revocations and closed epochs of one shuffler."""

    #: The DB-API placeholder of the dialect's driver.
    mark: ClassVar[str]

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @abstractmethod
    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` in this dialect."""

    # --- intake ---------------------------------------------------------------------------

    def insert(self, pending: Sequence[Pending]) -> list[str | Conflict]:
        """Commit contributions in ONE transaction (group commit): a receipt per row that
        landed, else which unique constraint it hit (the nonce, or the quota).

        One multi-row ``INSERT ... ON CONFLICT DO NOTHING`` per (up to) 100 rows, written once
        per row count and sent as is: per-row SQLAlchemy compilation costs more than the insert
        itself. When the database reports every row inserted (the common case) that is the
        whole transaction; otherwise the rows that landed are the receipts found afterwards.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the database is unavailable (nothing stored).
        """
        receipts = new_receipts(len(pending))
        rows = [_row(p, r) for p, r in zip(pending, receipts, strict=True)]
        c = storage.contributions.c
        with self.engine.begin() as conn:
            if self._insert_rows(conn, rows) == len(rows):
                return list(receipts)
            landed = set(conn.execute(select(c.receipt).where(c.receipt.in_(receipts))).scalars())
            missing = [row[_NONCE] for row in rows if row[_RECEIPT] not in landed]
            taken = set(conn.execute(select(c.nonce).where(c.nonce.in_(missing))).scalars())
        return [_landing(row, landed, taken) for row in rows]

    def _insert_rows(self, conn: Connection, rows: list[Row]) -> int:
        """Rows inserted, or -1 when the driver cannot tell (the caller then looks up)."""
        inserted = 0
        for start in range(0, len(rows), _ROWS_PER_STATEMENT):
            chunk = rows[start : start + _ROWS_PER_STATEMENT]
            result = conn.exec_driver_sql(
                _insert_sql(self.mark, len(chunk)), tuple(value for row in chunk for value in row)
            )
            if result.rowcount is None or result.rowcount < 0:
                return -1
            inserted += result.rowcount
        return inserted

    def revoke(self, client_id: str, now: float) -> None:
        """Persist a revocation (idempotent)."""
        with self.engine.begin() as conn:
            conn.execute(
                self.insert_ignore(storage.revoked).values(client_id=client_id, revoked_at=now)
            )

    def revoked(self) -> set[str]:
        """Every revoked client id."""
        with self.engine.connect() as conn:
            return set(conn.execute(select(storage.revoked.c.client_id)).scalars())

    def close_epoch(self, channel_id: str, epoch: int, now: float) -> None:
        """Persist that every epoch <= ``epoch`` of a channel is closed (idempotent)."""
        values = {"channel_id": channel_id, "epoch": epoch, "closed_at": now}
        with self.engine.begin() as conn:
            conn.execute(self.insert_ignore(storage.closed_epochs).values(**values))

    def closed_epochs(self) -> dict[str, int]:
        """The latest closed epoch of each channel."""
        e = storage.closed_epochs.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(e.channel_id, func.max(e.epoch)).group_by(e.channel_id))
            return {channel: int(epoch) for channel, epoch in rows}

    # --- batching -------------------------------------------------------------------------

    def open_groups(self) -> list[tuple[GroupKey, int]]:
        """Every group with contributions awaiting evaluation, and how many."""
        c = storage.contributions.c
        query = (
            select(c.channel_id, c.crowd_id, c.epoch, func.count())
            .where(c.held_part.is_(None))
            .group_by(c.channel_id, c.crowd_id, c.epoch)
        )
        with self.engine.connect() as conn:
            return [(GroupKey(ch, cr, int(ep)), int(n)) for ch, cr, ep, n in conn.execute(query)]

    def evaluate_group(
        self,
        key: GroupKey,
        limit: int,
        final: bool,
        evaluate: Callable[[list[bytes]], Evaluation],
        seal: Seal,
        now: float,
    ) -> Evaluation | None:
        """Apply ``evaluate`` (Algorithm 3) to the group's oldest ``limit`` waiting
        contributions and store its outcome, all in one transaction; a released batch is
        stored as the parts ``seal`` yields, each inserted as soon as it is signed (one part's
        body in memory at a time). None when there is nothing to evaluate (or, unless
        ``final``, fewer than ``limit``).

        Raises:
            sqlalchemy.exc.IntegrityError: another worker evaluated this part first.
        """
        c = storage.contributions.c
        with self.engine.begin() as conn:
            part = conn.execute(
                select(func.count())
                .select_from(storage.groups)
                .where(*_group_filter(key, storage.groups))
            ).scalar_one()
            rows = conn.execute(
                select(c.id, c.fragments)
                .where(*_group_filter(key, storage.contributions), c.held_part.is_(None))
                .order_by(c.id)
                .limit(limit)
            ).all()
            if not rows or (not final and len(rows) < limit):
                return None
            ids = [row[0] for row in rows]
            outcome = evaluate([row[1] for row in rows])
            del rows
            _apply(conn, key, part, ids, outcome, now)
            if outcome.batch is not None:
                _insert_batch(conn, key, outcome.batch, seal, now)
        return outcome

    # --- forwarding -----------------------------------------------------------------------

    def due_parts(self, now: float) -> list[PartKey]:
        """Undelivered parts whose next attempt is due and that no forwarder holds, oldest
        first (one round); a forwarder must :meth:`claim` each before sending it."""
        p = storage.batch_parts.c
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
        row updated (PROTOCOL.md: exactly one forwarder at a time).
        """
        p = storage.batch_parts.c
        with self.engine.begin() as conn:
            taken = conn.execute(
                update(storage.batch_parts)
                .where(*_part_filter(key), p.status == "pending", _unleased(now))
                .values(lease_until=now + lease_seconds)
            ).rowcount
            if taken != 1:
                return None
            row = conn.execute(
                select(p.body, p.signature, p.attempts).where(*_part_filter(key))
            ).one()
        return DuePart(key.batch_id, key.part, row[0], row[1], int(row[2]))

    def record_forwarded(self, key: PartKey, now: float) -> None:
        """The analyzer acknowledged the part; the batch is forwarded once all its parts are.

        The batch row is locked first (PostgreSQL), so when the last two parts are acknowledged
        concurrently the second transaction sees the first's part and marks the batch.
        """
        p, b = storage.batch_parts.c, storage.batches.c
        waiting = exists().where(p.batch_id == key.batch_id, p.status != "forwarded")
        with self.engine.begin() as conn:
            conn.execute(select(b.batch_id).where(b.batch_id == key.batch_id).with_for_update())
            conn.execute(
                update(storage.batch_parts)
                .where(*_part_filter(key))
                .values(status="forwarded", forwarded_at=now, lease_until=None, last_error=None)
            )
            conn.execute(
                update(storage.batches)
                .where(b.batch_id == key.batch_id, b.status != "forwarded", ~waiting)
                .values(status="forwarded", forwarded_at=now)
            )

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
        pending = storage.batch_parts.c.status == "pending"
        with self.engine.begin() as conn:
            conn.execute(
                update(storage.batch_parts).where(*_part_filter(key), pending).values(**changes)
            )

    # --- retention and accounting ---------------------------------------------------------

    def purge(self, cutoff: float, now: float) -> int:
        """Delete contributions and undelivered batches older than ``cutoff``; the count of
        contributions deleted is recorded (in one transaction) and returned."""
        c, b, p = storage.contributions.c, storage.batches.c, storage.batch_parts.c
        # A batch with a part being sent (leased) or already delivered is not purged: the
        # analyzer may count it, and a purge would then count the same contributions twice.
        in_flight = exists().where(
            p.batch_id == b.batch_id, or_(p.lease_until >= now, p.status == "forwarded")
        )
        with self.engine.begin() as conn:
            old = list(conn.execute(select(c.id).where(c.received_at < cutoff)).scalars())
            stale = conn.execute(
                select(b.batch_id, b.n_contributions).where(
                    b.status != "forwarded", b.created_at < cutoff, ~in_flight
                )
            ).all()
            _delete_ids(conn, old)
            if stale:
                ids = [s[0] for s in stale]
                conn.execute(
                    delete(storage.batch_parts).where(storage.batch_parts.c.batch_id.in_(ids))
                )
                conn.execute(delete(storage.batches).where(b.batch_id.in_(ids)))
            total = len(old) + sum(int(s[1]) for s in stale)
            if total:
                conn.execute(
                    insert(storage.purges).values(
                        reason="retention", contributions=total, purged_at=now
                    )
                )
        return total

    def ledger(self) -> dict[str, int]:
        """Where every acknowledged contribution went (for audits, metrics and tests)."""
        c, b, g = storage.contributions.c, storage.batches.c, storage.groups.c
        count = select(func.count()).select_from(storage.contributions)
        queries = {
            "pending": count.where(c.held_part.is_(None)),
            "held": count.where(c.held_part.is_not(None)),
            "in_batches_forwarded": select(func.sum(b.n_contributions)).where(
                b.status == "forwarded"
            ),
            "in_batches_unforwarded": select(func.sum(b.n_contributions)).where(
                b.status != "forwarded"
            ),
            "deleted_by_algorithm_3": select(func.sum(g.deleted)),
            "purged": select(func.sum(storage.purges.c.contributions)),
        }
        with self.engine.connect() as conn:
            return {name: int(conn.execute(q).scalar_one() or 0) for name, q in queries.items()}


def _landing(row: Row, landed: set[str], taken: set[bytes]) -> str | Conflict:
    if row[_RECEIPT] in landed:
        return str(row[_RECEIPT])
    return Conflict.REPLAYED_NONCE if row[_NONCE] in taken else Conflict.OVER_QUOTA


def _apply(
    conn: Connection, key: GroupKey, part: int, ids: list[int], outcome: Evaluation, now: float
) -> None:
    """Store Algorithm 3's outcome: hold the contributions, or delete them (the caller stores
    the batch)."""
    deletion = outcome.deletion
    c = storage.contributions.c
    if deletion.status is GroupStatus.HELD:
        conn.execute(update(storage.contributions).where(c.id.in_(ids)).values(held_part=part))
    else:
        _delete_ids(conn, ids)
    conn.execute(
        insert(storage.groups).values(
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


def _insert_batch(
    conn: Connection, key: GroupKey, batch: ShuffledBatch, seal: Seal, now: float
) -> None:
    parts = 0
    for sealed in seal(batch):
        conn.execute(
            insert(storage.batch_parts).values(
                batch_id=sealed.batch_id,
                part=sealed.part,
                body=sealed.body,
                signature=sealed.signature,
                status="pending",
                created_at=now,
                attempts=0,
                next_attempt_at=now,
            )
        )
        parts += 1
    conn.execute(
        insert(storage.batches).values(
            batch_id=batch.batch_id,
            channel_id=key.channel_id,
            epoch=key.epoch,
            n_contributions=batch.n_contributions,
            parts=parts,
            status="pending",
            created_at=now,
        )
    )


def _part_filter(key: PartKey) -> list[Any]:
    p = storage.batch_parts.c
    return [p.batch_id == key.batch_id, p.part == key.part]


def _unleased(now: float) -> Any:
    lease = storage.batch_parts.c.lease_until
    return or_(lease.is_(None), lease < now)


def _delete_ids(conn: Connection, ids: list[int]) -> None:
    for start in range(0, len(ids), _IDS_PER_DELETE):
        chunk = ids[start : start + _IDS_PER_DELETE]
        conn.execute(delete(storage.contributions).where(storage.contributions.c.id.in_(chunk)))


#: SQLite write-ahead-log pages between checkpoints (SQLite's default is 1,000).
WAL_AUTOCHECKPOINT_PAGES = 10_000


def _checkpoint_interval(dbapi_connection: Any, _: Any) -> None:
    """Checkpoint the SQLite write-ahead log every 10,000 pages (~40 MB) instead of 1,000.

    Ingest touches random pages of the nonce and quota indexes; a checkpoint copies each page
    once however often it changed since the last one, so checkpointing less often writes far
    less. Durability is unchanged: a commit is on disk (in the log) when it returns.
    """
    dbapi_connection.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")


class SqliteContributionStore(ContributionStore):
    """SQLite (one file, write-ahead log): ``?`` placeholders, less frequent checkpoints."""

    mark = "?"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        event.listen(engine, "connect", _checkpoint_interval)

    def insert_ignore(self, table: Table) -> Insert:
        return sqlite_insert(table).on_conflict_do_nothing()


class PostgresContributionStore(ContributionStore):
    """PostgreSQL (psycopg): ``%s`` placeholders."""

    mark = "%s"

    def insert_ignore(self, table: Table) -> Insert:
        return pg_insert(table).on_conflict_do_nothing()


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
