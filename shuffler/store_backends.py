"""The two dialects of the contribution store, and :func:`make_store`, which picks one.

:class:`SqliteContributionStore` and :class:`PostgresContributionStore` supply what differs
between databases under :class:`shuffler.store.ContributionStore`'s one interface: the
insert-ignore construct, the driver's placeholder, the group commit (a multi-row ``INSERT`` on
the writer's own connection, or one ``unnest`` statement), connection tuning, and the locks that
keep replicas apart. Nothing else in the shuffler looks at the dialect. Why the locking holds:
docs/shuffler.md, "Storage, locking and durability".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Table, event, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.dml import Insert

from runtime import db
from shuffler import tables
from shuffler.records import GroupKey
from shuffler.store import READ_ROWS, ContributionStore
from shuffler.store_queries import (
    CHANNEL,
    CLIENT,
    COLUMNS,
    EPOCH,
    NONCE,
    RECEIPT,
    Ids,
    Landings,
    Row,
    VanishedError,
    admitted,
    nonces_among,
    refused_nonces,
    unheld,
)
from shuffler.uniqueness import HeldKeys, Key, writer_lock

_ROWS_PER_STATEMENT = 100  # 900 parameters: under SQLite's historical limit of 999
_PARAMETERS_PER_CHECK = 900  # a check statement's clients and channels together (same limit)
#: How long a close or revocation waits for the running inserts before it gives up (ingest
#: queues behind it meanwhile): :meth:`PostgresContributionStore._barrier`.
BARRIER_TIMEOUT_MS = 2_000
#: A connection held for inserts is used again without the pool's ping while it was used less
#: than this long ago (a busy writer); after that it goes back through the pool, which pings it.
HELD_IDLE_SECONDS = 1.0

log = logging.getLogger("esa.shuffler")


@functools.lru_cache(maxsize=256)
def _insert_sql(mark: str, rows: int) -> str:
    """``INSERT INTO contributions (...) VALUES (...), ... ON CONFLICT DO NOTHING``."""
    values = "(" + ", ".join([mark] * len(COLUMNS)) + ")"
    return (
        f"INSERT INTO {tables.contributions.name} ({', '.join(COLUMNS)}) "
        f"VALUES {', '.join([values] * rows)} ON CONFLICT DO NOTHING"
    )


#: The group commit on PostgreSQL, one statement (so one transaction, in autocommit): the rows
#: as nine arrays in :data:`COLUMNS` order; reads the revoked clients and the latest closed
#: epoch of each channel among them (``r``, ``e``), inserts the rows neither revoked nor late
#: and returns the receipts that landed (``i``). One snapshot for the reads and the insert.
_PG_INSERT = f"""
WITH v AS (
  SELECT * FROM unnest(%b::text[], %b::text[], %b::bigint[], %b::text[], %b::bytea[],
                       %b::bytea[], %b::integer[], %b::float8[], %b::text[])
    AS v({", ".join(COLUMNS)})
), r AS (
  SELECT client_id FROM {tables.revoked.name} WHERE client_id IN (SELECT client_id FROM v)
), e AS (
  SELECT channel_id, max(epoch) AS epoch FROM {tables.closed_epochs.name}
  WHERE channel_id IN (SELECT channel_id FROM v) GROUP BY channel_id
), i AS (
  INSERT INTO {tables.contributions.name} ({", ".join(COLUMNS)})
  SELECT {", ".join(COLUMNS)} FROM v
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


#: The keys of the stored rows of epochs still open, for :class:`HeldKeys`.
_OPEN_KEYS_SQL = (
    f"SELECT c.channel_id, c.epoch, c.client_id, c.nonce FROM {tables.contributions.name} c "
    f"WHERE c.epoch > COALESCE((SELECT max(e.epoch) FROM {tables.closed_epochs.name} e "
    "WHERE e.channel_id = c.channel_id), -1)"
)


def _key(row: Row) -> Key:
    """What the replay and quota checks read of a row."""
    return Key(row[CHANNEL], row[EPOCH], row[CLIENT], row[NONCE])


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
                    cursor, self.mark, {r[CLIENT] for r in rows}, {r[CHANNEL] for r in rows}
                )
                held.forget_closed(closed)
                kept = admitted(rows, revoked, closed)
                fresh, replayed = held.sort([_key(row) for row in kept])
                new = [kept[index] for index in fresh]
                if _insert_rows(cursor, self.mark, new) != len(new):  # only a receipt collides
                    raise sqlite3.IntegrityError("a receipt collided: nothing was stored")
            held.add(_key(row) for row in new)
        return revoked, closed, {row[RECEIPT] for row in new}, replayed

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
                missing = refused_nonces(rows, revoked, closed, landed)
                if missing:  # a unique constraint refused these (rare: a replay, or over quota)
                    landings = (revoked, closed, landed, nonces_among(conn, missing))
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
            VanishedError: a survivor's row was deleted meanwhile (a retention purge).
        """
        c = tables.contributions.c
        wanted = np.sort(survivors)
        if not wanted.size:
            return
        query = db.binary_rows(select(c.id, c.fragments).where(*unheld(key)))
        streamed = conn.execution_options(stream_results=True, max_row_buffer=READ_ROWS)
        found = 0
        for rows in streamed.execute(query).partitions(READ_ROWS):
            ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
            at = np.minimum(np.searchsorted(wanted, ids), wanted.size - 1)
            keep = wanted[at] == ids
            found += int(keep.sum())
            yield [bytes(row[1]) for row, kept in zip(rows, keep, strict=True) if kept]
        if found != wanted.size:
            raise VanishedError(f"{wanted.size - found} contributions vanished")

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
        """Nothing: :meth:`record_group` locks the group's rows (``FOR UPDATE``) as it reads
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
