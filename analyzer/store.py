"""The analyzer's storage: receipts, accumulators and releases behind one interface.

Tables (SQLAlchemy Core; created by the alembic migrations next to this module): ``batch_parts``
(the raw part until opened, then its counts; ``quarantined`` after
:data:`analyzer.opening.OPEN_ATTEMPTS` failed openings), ``open_batches``, ``receipts`` (claimed
and verified crowd; ``withheld`` below ``min_crowd``), ``accumulators`` per (channel, crowd,
epoch, shuffler), ``epoch_charges`` (the privacy ledger: one row per (channel, crowd, epoch),
rewritten under its lock with every batch), ``epoch_closures`` (groups closed at their
timeout), ``shuffler_descriptors`` and ``releases``; ``seen_epochs`` and ``seen_parts`` (each
sealed fragment counted once) are :mod:`analyzer.seen`'s, written in the fold's transaction.
Reads write nothing. Everything that depends on the database dialect stays in this module.

What each table holds and why: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Select,
    String,
    Table,
    Text,
    case,
    delete,
    false,
    func,
    insert,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from analyzer import seen
from analyzer.errors import StorageConflictError
from common.wire import Bound, ReleaseBody
from runtime import db
from runtime.failpoints import failpoint

metadata = MetaData()

receipts = Table(
    "receipts",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("shuffler_id", String(64), nullable=False),
    Column("channel_id", String(64), nullable=False, index=True),
    Column("crowd_id", String(255), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("n_contributions", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("invalid", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("n_verified", Integer, nullable=True),
    Column("withheld", Boolean, nullable=False, server_default=false()),
)

accumulators = Table(
    "accumulators",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("shuffler_id", String(64), primary_key=True),
    Column("state", LargeBinary, nullable=False),
    Column("batches", Integer, nullable=False),
)

releases = Table(
    "releases",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("channel_id", String(64), nullable=False, index=True),
    Column("epoch_from", BigInteger, nullable=False),
    Column("epoch_to", BigInteger, nullable=False),
    Column("n", Integer, nullable=False),
    Column("certificate", Text, nullable=False),
    Column("summary", Text, nullable=False),
    Column("released_at", Float, nullable=False),
)

epoch_charges = Table(
    "epoch_charges",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("certificate", Text, nullable=False),
    Column("batches", Integer, nullable=False),
    Column("charged_at", Float, nullable=False),
)

batch_parts = Table(
    "batch_parts",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("part", Integer, primary_key=True),
    Column("parts", Integer, nullable=False),
    Column("shuffler_id", String(64), nullable=False),
    Column("channel_id", String(64), nullable=False),
    Column("crowd_id", String(255), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("n_contributions", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("body", LargeBinary, nullable=True),
    Column("status", String(16), nullable=False, index=True),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text, nullable=True),
    Column("invalid", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("n_opened", Integer, nullable=True),
    Index("ix_batch_parts_group", "shuffler_id", "channel_id", "crowd_id", "epoch"),
)

shuffler_descriptors = Table(
    "shuffler_descriptors",
    metadata,
    Column("shuffler_id", String(64), primary_key=True),
    Column("issued_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("document", Text, nullable=False),
)

#: The channels added and retired at runtime, as a log whose ``version`` numbers the configs.
channel_changes = Table(
    "channel_changes",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=True),
    Column("channel_id", String(64), nullable=False),
    Column("action", String(16), nullable=False),
    Column("config", Text, nullable=True),
    Column("retired_from_epoch", BigInteger, nullable=True),
    Column("changed_at", Float, nullable=False),
    Index("ix_channel_changes_channel", "channel_id"),
)

#: The groups closed for good at their timeout (:meth:`AnalyzerStore.close_group`): the
#: shufflers whose batches their releases rest on, as a sorted JSON list.
epoch_closures = Table(
    "epoch_closures",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("shufflers", Text, nullable=False),
    Column("closed_at", Float, nullable=False),
)

#: ``channel_changes.action``.
ADD, RETIRE = "add", "retire"

#: ``batch_parts.status``: waiting for the opener, folded in, or set aside after failed openings.
STORED, OPENED, QUARANTINED = "stored", "opened", "quarantined"
#: Longest ``last_error`` kept for a failed opening.
ERROR_CHARS = 2000

open_batches = Table(
    "open_batches",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("state", LargeBinary, nullable=False),
    Column("opened", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("invalid", Integer, nullable=False),
)

#: Attempts to store one batch when concurrent writers create the same accumulator row.
STORE_ATTEMPTS = 5

#: Stored parts the opener reads per query (a page of headers, never their bodies).
PENDING_PAGE = 100

#: Folds an opened part into its batch's statistics: (serialized state (None when new),
#: positions of its opened fragments counted before, left out) → (new state, invalid
#: fragments, the repeated ones included).
Fold = Callable[[bytes | None, Collection[int]], tuple[bytes, int]]
#: Completes a batch whose last part was folded: (state, valid fragments, invalid fragments) →
#: its :class:`Completion`.
Complete = Callable[[bytes, int, int], "Completion"]
#: Merges a complete batch's statistics into an accumulator (None when new) → new state.
Merge = Callable[[bytes | None, bytes], bytes]


@dataclass(frozen=True, slots=True)
class ChannelLogRow:
    """One row of the channel log: ``add`` (with the config as JSON) or ``retire``."""

    version: int
    channel_id: str
    action: str
    config: str | None
    retired_from_epoch: int | None


@dataclass(frozen=True, slots=True)
class PartHeader:
    """What a stored part says about itself (docs/protocol.md, "Batches and parts"); its
    fragments stay in the stored body until they are opened."""

    batch_id: str
    part: int
    parts: int
    shuffler_id: str
    channel_id: str
    crowd_id: str
    epoch: int
    n_contributions: int
    n_fragments: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A complete batch's statistics with its verified crowd in them, the verified crowd, and
    whether it may be released (False: below its channel's ``min_crowd``, withheld)."""

    state: bytes
    verified: int
    released: bool


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """What intake checks a new part against: its batch's parts stored so far, and another
    batch already received for the same group (shuffler, channel, crowd, epoch), if any."""

    parts: list[PartHeader]
    rival: str | None


@dataclass(frozen=True, slots=True)
class CrowdCheck:
    """Claimed against verified crowds over a channel's complete batches in a range, and the
    batches withheld because their verified crowd is below ``min_crowd``."""

    batches: int
    claimed: int
    verified: int
    invalid: int
    short: int
    withheld: int


@dataclass(frozen=True, slots=True)
class PartStatus:
    """Where a stored part stands: ``stored``, ``opened`` or ``quarantined``, with its failed
    openings and the last one's error."""

    status: str
    attempts: int
    last_error: str | None


class BatchProgress(NamedTuple):
    """An incomplete batch: parts opened, parts in all, parts quarantined (never opened)."""

    opened: int
    parts: int
    quarantined: int = 0


class FragmentCounts(NamedTuple):
    """A channel's fragments in opened parts: opened (decrypted), and failed to open or parse
    (``invalid``; a fragment that opened but did not parse is in both)."""

    opened: int
    invalid: int


class Folded(Enum):
    """What folding one part did: added it to its open batch, or completed the batch."""

    PART = "part"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class BatchReceipt:
    """What the receipt of an accepted batch records (its fragments go to the accumulator)."""

    batch_id: str
    shuffler_id: str
    channel_id: str
    crowd_id: str
    epoch: int
    n_contributions: int
    n_fragments: int
    n_verified: int


@dataclass(frozen=True, slots=True)
class StoredState:
    """One accumulator row in a release's range."""

    epoch: int
    shuffler_id: str
    state: bytes


@dataclass(frozen=True, slots=True)
class ReceivedRange:
    """What a release may read: accumulators and the crowd size of every batch behind them."""

    states: list[StoredState]
    batch_sizes: dict[tuple[int, str], tuple[int, ...]]


class Group(NamedTuple):
    """One (channel, crowd, epoch): what each shuffler sends at most one batch for."""

    channel_id: str
    crowd_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class DeliveredBatch:
    """A complete batch as its receipt records it: its group's epoch, its shuffler, the crowd
    it claims and the one it verifies, its fragments that failed to open or parse, and whether
    it was withheld below ``min_crowd``."""

    epoch: int
    shuffler_id: str
    claimed: int
    verified: int
    invalid: int
    withheld: bool


#: The charge of one epoch from everything received in it: certificates as JSON (None: nothing
#: a certificate can rest on yet).
Charge = Callable[[ReceivedRange], str | None]


@dataclass(frozen=True, slots=True)
class StoredCharge:
    """One (channel, crowd, epoch) row of the privacy ledger."""

    channel_id: str
    crowd_id: str
    epoch: int
    certificate: str
    batches: int
    charged_at: float


@dataclass(frozen=True, slots=True)
class StoredRelease:
    """One ledger entry as stored."""

    id: int
    epoch_from: int
    epoch_to: int
    n: int
    certificate: Bound
    released_at: float


class AnalyzerStore:
    """Receipts, accumulators and releases over one SQLAlchemy engine."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock
        self._storing = threading.Lock()
        self.seen = seen.SeenRecord()

    # --- intake (store a part, open it in the background) ---------------------------------

    def stored_parts(self, batch_id: str) -> list[PartHeader]:
        """The headers of a batch's parts stored so far (the first part fixes the batch)."""
        with self.engine.connect() as conn:
            return _stored_parts(conn, batch_id)

    def store_part(
        self, header: PartHeader, body: bytes, check: Callable[[StoredBatch], None]
    ) -> bool:
        """Durably store one signed part unless (``batch_id``, ``part``) is known; ``check``
        sees the batch's other stored parts and any other batch of its group first (and
        raises to refuse). Returns False for a known part (a repeat, or a batch accepted whole
        before parts existed).
        """

        def store(conn: Connection) -> bool:
            # Analyzer workers: two parts of one batch, or of two batches of one group, stored
            # at once by two processes are checked against each other, one after the other
            # (PostgreSQL): a group never gets a second batch.
            _lock_batch(conn, header)
            if _known(conn, header):
                return False
            check(StoredBatch(_stored_parts(conn, header.batch_id), _rival(conn, header)))
            conn.execute(
                insert(batch_parts).values(
                    **asdict(header),
                    body=body,
                    status=STORED,
                    attempts=0,
                    invalid=0,
                    received_at=self.clock(),
                )
            )
            return True

        with self._storing:
            try:
                return db.run_tx(self.engine, "analyzer.store_part", store)
            except IntegrityError:  # not retried: the part stored meanwhile is a repeat
                if self._known(header):
                    return False
                raise

    def _known(self, header: PartHeader) -> bool:
        with self.engine.connect() as conn:
            return _known(conn, header)

    def pending_parts(
        self, limit: int = PENDING_PAGE, after: PartHeader | None = None
    ) -> list[PartHeader]:
        """Stored parts waiting for the opener, oldest first (what it resumes after a crash);
        ``after`` pages on past a part (keyset on (``received_at``, ``batch_id``, ``part``)), so
        parts the opener skips never hide the ones behind them."""
        p = batch_parts.c
        order = (p.received_at, p.batch_id, p.part)
        query = select(*_HEADER).where(p.status == STORED).order_by(*order).limit(limit)
        if after is not None:
            received_at = (
                select(p.received_at)
                .where(p.batch_id == after.batch_id, p.part == after.part)
                .scalar_subquery()
            )
            query = query.where(tuple_(*order) > tuple_(received_at, after.batch_id, after.part))
        with self.engine.connect() as conn:
            return [PartHeader(*row) for row in conn.execute(query)]

    @contextlib.contextmanager
    def opening(self, header: PartHeader) -> Iterator[bool]:
        """Whether this process may open ``header``'s part now (analyzer workers).

        SQLite: always (one analyzer process per database). PostgreSQL: a session advisory
        lock on the part, tried (``pg_try_advisory_lock``) on a dedicated connection held while
        the part is opened and folded, so W analyzer processes paging through the same stored
        parts open each once instead of all opening it and all but one discarding the work;
        a worker killed mid-way loses its connection and the lock with it, and another takes
        the part over. Correctness does not rest on it: :meth:`fold_part` locks the part's row
        and folds it only while it is still ``stored``.
        """
        with db.try_advisory_lock(
            self.engine, ["analyzer-part", header.batch_id, header.part]
        ) as mine:
            yield mine

    def unopened_parts(self) -> int:
        """How many stored parts wait for the opener (the intake backlog; quarantined parts
        are not waiting, see :meth:`quarantined_parts`)."""
        return self._parts_with(STORED)

    def oldest_unopened_at(self) -> float | None:
        """When the oldest stored part still waiting for the opener was received (None: none
        waits): the analyzer keeps a retired HPKE key while parts from before it retired wait
        (:class:`runtime.keys.LiveKeys`)."""
        p = batch_parts.c
        query = select(func.min(p.received_at)).where(p.status == STORED)
        with self.engine.connect() as conn:
            found = conn.execute(query).scalar_one()
        return None if found is None else float(found)

    def quarantined_parts(self) -> int:
        """How many parts were set aside after failed openings."""
        return self._parts_with(QUARANTINED)

    def fragment_ledger(self, channel_ids: Collection[str]) -> dict[str, FragmentCounts]:
        """Per channel of ``channel_ids`` (the collection config: nothing else becomes a
        label), its fragments in every part opened so far, by whichever analyzer worker:
        opened, and failed to open or parse. One statement, so one snapshot on both databases
        (a part folded meanwhile counts in both sums or in neither). It is the sum of
        ``fragments_opened`` and ``fragments_invalid`` of every process that ever opened a part
        of the database (:class:`analyzer.metrics.AnalyzerEvents`); a part opened before
        migration 0006 counts ``n_fragments - invalid`` as opened (its undecryptable fragments
        were not kept apart from its unparsable ones). Parts waiting or quarantined count
        nowhere."""
        p = batch_parts.c
        opened = func.coalesce(p.n_opened, p.n_fragments - p.invalid)
        query = (
            select(p.channel_id, func.sum(opened), func.sum(p.invalid))
            .where(p.status == OPENED, p.channel_id.in_(sorted(channel_ids)))
            .group_by(p.channel_id)
        )
        found = dict.fromkeys(channel_ids, FragmentCounts(0, 0))
        with self.engine.connect() as conn:
            for channel_id, n_opened, invalid in conn.execute(query):
                found[channel_id] = FragmentCounts(int(n_opened or 0), int(invalid or 0))
        return found

    def _parts_with(self, status: str) -> int:
        query = select(func.count()).select_from(batch_parts).where(batch_parts.c.status == status)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def part_status(self, header: PartHeader) -> PartStatus | None:
        """A stored part's status, failed openings and last error (None if not stored)."""
        p = batch_parts.c
        query = select(p.status, p.attempts, p.last_error).where(
            p.batch_id == header.batch_id, p.part == header.part
        )
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else PartStatus(row.status, int(row.attempts), row.last_error)

    def part_body(self, header: PartHeader) -> bytes | None:
        """The signed body of a part waiting for the opener, None once opened or quarantined."""
        p = batch_parts.c
        query = db.binary_rows(
            select(p.body).where(
                p.batch_id == header.batch_id, p.part == header.part, p.status == STORED
            )
        )
        with self.engine.connect() as conn:
            body = conn.execute(query).scalar_one_or_none()
        return None if body is None else bytes(body)

    def record_failure(self, header: PartHeader, error: str, quarantine_after: int) -> bool:
        """Count one failed opening of a waiting part and keep its error; at
        ``quarantine_after`` failures the part is quarantined (never opened again by itself,
        never folded in). Returns True if this failure quarantined it."""
        p = batch_parts.c
        key = (p.batch_id == header.batch_id, p.part == header.part, p.status == STORED)

        def count(conn: Connection) -> bool:
            before = conn.execute(_locked(conn, select(p.attempts).where(*key))).scalar()
            if before is None:
                return False
            attempts = int(before) + 1
            quarantined = attempts >= quarantine_after
            conn.execute(
                update(batch_parts)
                .where(*key)
                .values(
                    attempts=attempts,
                    last_error=error[:ERROR_CHARS],
                    status=QUARANTINED if quarantined else STORED,
                )
            )
            return quarantined

        return db.run_tx(self.engine, "analyzer.record_failure", count)

    def purge_incomplete(self, before: float) -> int:
        """Delete the parts of batches that never completed and received nothing since
        ``before`` (their shuffler purged the rest, e.g. after a refusal: they can no longer
        complete, and every release would name them forever); returns the parts deleted."""
        p, r = batch_parts.c, receipts.c
        stale = (
            select(p.batch_id)
            .where(~select(r.batch_id).where(r.batch_id == p.batch_id).exists())
            .group_by(p.batch_id)
            .having(func.max(p.received_at) < before)
        )

        def purge(conn: Connection) -> int:
            ids = [str(b) for b in conn.execute(stale).scalars()]
            if not ids:
                return 0
            conn.execute(delete(open_batches).where(open_batches.c.batch_id.in_(ids)))
            return int(conn.execute(delete(batch_parts).where(p.batch_id.in_(ids))).rowcount)

        return db.run_tx(self.engine, "analyzer.purge_incomplete", purge, lock=self._storing)

    def forget_fragments(self, before: float) -> int:
        """Drop the record (:mod:`analyzer.seen`) of every (channel, epoch) that received no
        part since ``before`` (retention: the records go with their epoch), in the database
        and in memory; how many keys. A part of such an epoch arriving later is checked for
        repeats against its own epoch's later parts only, which is why ``before`` is the
        incomplete-batch horizon, past every shuffler's retention."""
        p = batch_parts.c
        stale = (
            select(p.channel_id, p.epoch)
            .group_by(p.channel_id, p.epoch)
            .having(func.max(p.received_at) < before)
        )

        def forget(conn: Connection) -> tuple[list[tuple[str, int]], int]:
            groups = [(str(c), int(e)) for c, e in conn.execute(stale).all()]
            return groups, sum(seen.forget_rows(conn, group) for group in groups)

        groups, dropped = db.run_tx(
            self.engine, "analyzer.forget_fragments", forget, lock=self._storing
        )
        for group in groups:
            self.seen.forget(group)
        return dropped

    def requeue_quarantined(self, batch_id: str | None = None) -> int:
        """Put quarantined parts (of ``batch_id``, or all) back in the opener's queue with no
        failed attempt counted, after an operator fixed their cause; how many."""
        p = batch_parts.c
        query = update(batch_parts).where(p.status == QUARANTINED)
        if batch_id is not None:
            query = query.where(p.batch_id == batch_id)
        query = query.values(status=STORED, attempts=0)
        return db.run_tx(
            self.engine,
            "analyzer.requeue_quarantined",
            lambda conn: int(conn.execute(query).rowcount),
        )

    def keep_descriptor(
        self, shuffler_id: str, issued_at: int, expires_at: int, doc: str, *, stale: bool = False
    ) -> bool:
        """Keep a verified signed descriptor unless one issued as late or later is kept (or,
        when the kept one is ``stale``: signed by a key no longer pinned, in any case); True if
        it was kept. One statement each way, so concurrent workers keep the newest."""
        d = shuffler_descriptors.c
        values = {"issued_at": issued_at, "expires_at": expires_at, "document": doc}
        older = d.issued_at < issued_at

        def keep(conn: Connection) -> bool:
            newer = conn.execute(
                update(shuffler_descriptors)
                .where(d.shuffler_id == shuffler_id, true() if stale else older)
                .values(**values)
            ).rowcount
            if newer:
                return True
            if conn.execute(select(d.issued_at).where(d.shuffler_id == shuffler_id)).first():
                return False
            try:
                with conn.begin_nested():
                    conn.execute(
                        insert(shuffler_descriptors).values(shuffler_id=shuffler_id, **values)
                    )
            except IntegrityError:  # another worker kept one first: compare again next time
                return False
            return True

        return db.run_tx(self.engine, "analyzer.keep_descriptor", keep)

    def record_channel_change(
        self, channel_id: str, action: str, config: str | None, retired_from_epoch: int | None
    ) -> int:
        """Append one change to the channel log; its version (the config revision it starts).
        On PostgreSQL the log is locked for the insert, so versions commit in their order (a
        reader that saw version v has seen every version below it)."""

        def append(conn: Connection) -> int:
            if not db.is_sqlite(self.engine):
                conn.execute(text("LOCK TABLE channel_changes IN EXCLUSIVE MODE"))
            row = conn.execute(
                insert(channel_changes)
                .values(
                    channel_id=channel_id,
                    action=action,
                    config=config,
                    retired_from_epoch=retired_from_epoch,
                    changed_at=self.clock(),
                )
                .returning(channel_changes.c.version)
            ).one()
            return int(row[0])

        return db.run_tx(self.engine, "analyzer.record_channel_change", append)

    def channel_changes(self, after: int = 0) -> list[ChannelLogRow]:
        """The channel log after version ``after``, oldest first."""
        c = channel_changes.c
        query = select(c.version, c.channel_id, c.action, c.config, c.retired_from_epoch).where(
            c.version > after
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(c.version)).all()
        return [
            ChannelLogRow(
                version=int(v), channel_id=str(i), action=str(a), config=f, retired_from_epoch=r
            )
            for v, i, a, f, r in rows
        ]

    def channel_revision(self) -> tuple[int, int]:
        """The newest version in the channel log and how many changes it holds ((0, 0): none);
        both, so a version that committed after a later one is noticed."""
        c = channel_changes.c
        with self.engine.connect() as conn:
            newest, count = conn.execute(select(func.max(c.version), func.count())).one()
        return int(newest or 0), int(count)

    def descriptors(self) -> dict[str, tuple[int, str]]:
        """The kept descriptors: shuffler id → (expires_at, signed document as JSON)."""
        d = shuffler_descriptors.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(d.shuffler_id, d.expires_at, d.document)).all()
        return {str(sid): (int(expires), str(doc)) for sid, expires, doc in rows}

    def fold_part(
        self,
        header: PartHeader,
        fold: Fold,
        steps: tuple[Complete, Merge, Charge],
        *,
        n_opened: int,
        seal_keys: Sequence[bytes] = (),
    ) -> Folded | None:
        """Fold an opened part (``n_opened`` of its fragments decrypted, ``seal_keys`` theirs in
        order) into its batch's statistics and mark it opened with its fragment counts, in one
        transaction: its fragments counted before in the epoch are recorded there too, so a
        repeat is left out exactly once whatever crashes or retries (:mod:`analyzer.seen`);
        when it is the batch's last part, the batch gets its verified crowd (``steps``:
        complete), joins its accumulator (merge), gets its receipt and its epoch is recharged
        (charge) in the same transaction (so a batch counts once, whole, or not at all).
        Returns None if the part is no longer waiting (opened by another opener, or
        quarantined).

        Raises:
            StorageConflictError: if concurrent writers kept colliding.
        """

        def fold_in(conn: Connection) -> tuple[Folded | None, list[seen.Staged]]:
            staged: list[seen.Staged] = []  # each attempt stages afresh
            decrypted = (n_opened, seal_keys, self.seen, staged)
            folded = _fold_part(conn, header, fold, steps, decrypted, self.clock())
            if folded is Folded.PART:
                failpoint("analyzer.fold.part_before_commit")
            elif folded is Folded.BATCH:
                failpoint("analyzer.fold.batch_before_commit")
            return folded, staged

        try:
            # An IntegrityError is a concurrent writer's row: the next attempt reads it.
            folded, staged = db.run_tx(
                self.engine,
                "analyzer.fold_part",
                fold_in,
                attempts=STORE_ATTEMPTS,
                retry_on=(IntegrityError,),
                backoff=0.0,
                lock=self._storing,
            )
        except IntegrityError as error:
            raise StorageConflictError("could not fold the part; retry later") from error
        if folded is not None:
            failpoint("analyzer.fold.after_commit")
        # Memory follows the record only once its rows are committed.
        for part in staged:
            self.seen.commit(part)
        return folded

    def incomplete(
        self, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
    ) -> dict[str, BatchProgress]:
        """Batches in range with parts missing, not opened yet or quarantined: ``batch_id`` →
        (parts opened, parts, parts quarantined)."""
        p = batch_parts.c
        counted = (
            func.sum(case((p.status == status, 1), else_=0)) for status in (OPENED, QUARANTINED)
        )
        query = (
            select(p.batch_id, p.parts, *counted)
            .where(*_in_range(batch_parts, channel_id, crowd_id, epoch_from, epoch_to))
            .group_by(p.batch_id, p.parts)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
            done = {
                b
                for (b,) in conn.execute(
                    select(receipts.c.batch_id).where(
                        receipts.c.batch_id.in_([row[0] for row in rows])
                    )
                )
            }
        return {
            b: BatchProgress(int(o or 0), int(n), int(q or 0))
            for b, n, o, q in rows
            if b not in done
        }

    def uncharged(self) -> list[tuple[str, str, int]]:
        """(channel, crowd, epoch) with accumulators but no ledger row (databases from before
        ``epoch_charges``)."""
        a, c = accumulators.c, epoch_charges.c
        charged = select(c.channel_id).where(
            c.channel_id == a.channel_id, c.crowd_id == a.crowd_id, c.epoch == a.epoch
        )
        query = select(a.channel_id, a.crowd_id, a.epoch).where(~charged.exists()).distinct()
        with self.engine.connect() as conn:
            return [(ch, cr, int(e)) for ch, cr, e in conn.execute(query)]

    def recharge(self, channel_id: str, crowd_id: str, epoch: int, charge: Charge) -> None:
        """Write the ledger row of one epoch from what is stored."""
        key = BatchReceipt(
            batch_id="",
            shuffler_id="",
            channel_id=channel_id,
            crowd_id=crowd_id,
            epoch=epoch,
            n_contributions=0,
            n_fragments=0,
            n_verified=0,
        )
        db.run_tx(
            self.engine,
            "analyzer.recharge",
            lambda conn: _charge(conn, key, charge, self.clock()),
            lock=self._storing,
        )

    def charges(self, channel_id: str | None = None) -> list[StoredCharge]:
        """The ledger rows of one channel (or of all), by channel, epoch and crowd."""
        c = epoch_charges.c
        query = select(epoch_charges).order_by(c.channel_id, c.epoch, c.crowd_id)
        if channel_id is not None:
            query = query.where(c.channel_id == channel_id)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            StoredCharge(
                channel_id=row.channel_id,
                crowd_id=row.crowd_id,
                epoch=int(row.epoch),
                certificate=row.certificate,
                batches=int(row.batches),
                charged_at=float(row.charged_at),
            )
            for row in rows
        ]

    # --- releases -----------------------------------------------------------------------

    def received(
        self, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
    ) -> ReceivedRange:
        """Accumulators and batch crowd sizes of a channel's crowd in ``[from, to]``."""
        with self.engine.connect() as conn:
            return _received(conn, channel_id, crowd_id, epoch_from, epoch_to)

    def epoch_spans(self) -> dict[str, tuple[int, int]]:
        """``[first, last]`` epoch received per channel."""
        r = receipts.c
        query = select(r.channel_id, func.min(r.epoch), func.max(r.epoch)).group_by(r.channel_id)
        with self.engine.connect() as conn:
            return {c: (int(lo), int(hi)) for c, lo, hi in conn.execute(query)}

    def add_release(self, summary: ReleaseBody, other_notion: Bound | None) -> None:
        """Append a release to the ledger: its certificates and the summary the dashboard
        draws."""
        record = {
            "certificate": summary.certificate.model_dump(mode="json"),
            "other_notion": None if other_notion is None else other_notion.model_dump(mode="json"),
        }
        query = insert(releases).values(
            channel_id=summary.channel_id,
            epoch_from=summary.epochs[0],
            epoch_to=summary.epochs[1],
            n=summary.n,
            certificate=json.dumps(record),
            summary=summary.model_dump_json(),
            released_at=self.clock(),
        )

        def append(conn: Connection) -> None:
            conn.execute(query)
            failpoint("analyzer.release.before_commit")

        db.run_tx(self.engine, "analyzer.add_release", append)
        failpoint("analyzer.release.after_commit")

    def releases(self, channel_id: str) -> list[StoredRelease]:
        """A channel's releases, oldest first."""
        r = releases.c
        query = (
            select(r.id, r.epoch_from, r.epoch_to, r.n, r.certificate, r.released_at)
            .where(r.channel_id == channel_id)
            .order_by(r.id)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            StoredRelease(
                id=int(row.id),
                epoch_from=int(row.epoch_from),
                epoch_to=int(row.epoch_to),
                n=int(row.n),
                certificate=Bound.model_validate(json.loads(row.certificate)["certificate"]),
                released_at=float(row.released_at),
            )
            for row in rows
        ]

    def counts(self) -> dict[str, int]:
        """Rows per table (what a read must leave unchanged)."""
        with self.engine.connect() as conn:
            return {
                table.name: int(conn.execute(select(func.count()).select_from(table)).scalar_one())
                for table in (receipts, accumulators, epoch_charges, releases)
            }

    def latest_summary(self, channel_id: str) -> ReleaseBody | None:
        """The summary of a channel's most recent release, if any."""
        r = releases.c
        query = select(r.summary).where(r.channel_id == channel_id).order_by(r.id.desc()).limit(1)
        with self.engine.connect() as conn:
            text = conn.execute(query).scalar_one_or_none()
        return None if text is None else ReleaseBody.model_validate_json(text)

    def channel_health(self, epochs: int) -> list[EpochHealth]:
        """Per channel, its ``epochs`` newest epochs with a batch received, newest first (see
        :class:`EpochHealth`). Channels are whatever the stored batches name, so one added at
        runtime appears with its first batch and one retired keeps its rows. One snapshot;
        reads the receipts (one row per complete batch), the parts of incomplete batches
        (waiting or quarantined ones by the status index, and those of open batches) and the
        releases, never the parts of complete batches.

        Raises:
            ValueError: ``epochs`` is below 1.
        """
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got epochs={epochs}")
        with self.engine.connect() as conn:
            _read_snapshot(conn)
            complete = _complete_epochs(conn, epochs)
            incomplete = _incomplete_epochs(conn)
            keys = _newest_keys(set(complete) | set(incomplete), epochs)
            published = _releases_over(conn, keys)
        return [
            _epoch_health(
                key,
                complete.get(key, CompleteEpoch()),
                incomplete.get(key, IncompleteEpoch()),
                published.get(key, 0),
            )
            for key in keys
        ]

    # --- epoch closures (releases wait for every shuffler) --------------------------------

    def delivered(
        self, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
    ) -> list[DeliveredBatch]:
        """The complete batches of a channel's crowd in ``[from, to]`` (one per shuffler and
        epoch), withheld ones too: what each shuffler has delivered."""
        r = receipts.c
        query = select(
            r.epoch,
            r.shuffler_id,
            r.n_contributions,
            func.coalesce(r.n_verified, r.n_contributions),
            r.invalid,
            r.withheld,
        ).where(*_in_range(receipts, channel_id, crowd_id, epoch_from, epoch_to))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            DeliveredBatch(
                epoch=int(e),
                shuffler_id=str(s),
                claimed=int(c),
                verified=int(v),
                invalid=int(i),
                withheld=bool(w),
            )
            for e, s, c, v, i, w in rows
        ]

    def closures(
        self, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
    ) -> dict[int, frozenset[str]]:
        """The epochs of a channel's crowd in ``[from, to]`` closed at their timeout: epoch →
        the shufflers whose batches its releases rest on."""
        c = epoch_closures.c
        query = select(c.epoch, c.shufflers).where(
            *_in_range(epoch_closures, channel_id, crowd_id, epoch_from, epoch_to)
        )
        with self.engine.connect() as conn:
            return {int(e): frozenset(json.loads(s)) for e, s in conn.execute(query)}

    def open_groups(self, arriving_after: float) -> list[Group]:
        """Groups with a batch received (complete or not) and no closure, leaving out those
        with a part still waiting for the opener, or an incomplete batch whose last part
        arrived after ``arriving_after`` (both arrived in time: closing now would leave them
        out only because delivering or opening a batch takes a while)."""
        c, p, r = epoch_closures.c, batch_parts.c, receipts.c
        queries = [
            select(t.c.channel_id, t.c.crowd_id, t.c.epoch)
            .where(
                ~select(c.epoch)
                .where(
                    c.channel_id == t.c.channel_id,
                    c.crowd_id == t.c.crowd_id,
                    c.epoch == t.c.epoch,
                )
                .exists()
            )
            .distinct()
            for t in (receipts, batch_parts)
        ]
        waiting = select(p.channel_id, p.crowd_id, p.epoch).where(p.status == STORED).distinct()
        arriving = (
            select(p.channel_id, p.crowd_id, p.epoch)
            .where(~select(r.batch_id).where(r.batch_id == p.batch_id).exists())
            .group_by(p.batch_id, p.channel_id, p.crowd_id, p.epoch)
            .having(func.max(p.received_at) > arriving_after)
        )
        with self.engine.connect() as conn:
            found = {Group(ch, cr, int(e)) for q in queries for ch, cr, e in conn.execute(q)}
            busy = {
                Group(ch, cr, int(e)) for q in (waiting, arriving) for ch, cr, e in conn.execute(q)
            }
        return sorted(found - busy)

    def first_arrivals(self) -> dict[Group, float]:
        """Each group with an incomplete batch → when the first part of its incomplete batches
        arrived: a batch still arriving holds its group open one close timeout from there."""
        p, r = batch_parts.c, receipts.c
        query = (
            select(p.channel_id, p.crowd_id, p.epoch, func.min(p.received_at))
            .where(~select(r.batch_id).where(r.batch_id == p.batch_id).exists())
            .group_by(p.channel_id, p.crowd_id, p.epoch)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return {Group(ch, cr, int(e)): float(first) for ch, cr, e, first in rows}

    def close_group(self, group: Group) -> frozenset[str] | None:
        """Close ``group`` for good: its releases rest on the batches complete now (their
        shufflers are returned), never on one completing later. None if it was closed already
        (by another analyzer process). Under the group's epoch lock, which a completing batch
        takes to recharge its epoch: a batch counts here if its charge committed first."""
        r, c = receipts.c, epoch_closures.c
        key = (r.channel_id == group.channel_id, r.crowd_id == group.crowd_id)

        def close(conn: Connection) -> frozenset[str] | None:
            _lock_epoch(conn, *group)
            closed = select(c.epoch).where(
                c.channel_id == group.channel_id,
                c.crowd_id == group.crowd_id,
                c.epoch == group.epoch,
            )
            if conn.execute(closed).first() is not None:
                return None
            query = select(r.shuffler_id).where(*key, r.epoch == group.epoch).distinct()
            shufflers = frozenset(str(s) for s in conn.execute(query).scalars())
            conn.execute(
                insert(epoch_closures).values(
                    **group._asdict(),
                    shufflers=json.dumps(sorted(shufflers)),
                    closed_at=self.clock(),
                )
            )
            failpoint("analyzer.close.before_commit")
            return shufflers

        try:
            shufflers = db.run_tx(self.engine, "analyzer.close_group", close, lock=self._storing)
        except IntegrityError:  # not retried: another analyzer process closed it first
            return None
        if shufflers is None:
            return None
        failpoint("analyzer.close.after_commit")
        return shufflers


def _stored_parts(conn: Connection, batch_id: str) -> list[PartHeader]:
    p = batch_parts.c
    query = select(*_HEADER).where(p.batch_id == batch_id).order_by(p.part)
    return [PartHeader(*row) for row in conn.execute(query)]


def _rival(conn: Connection, header: PartHeader) -> str | None:
    """Another batch already received (a part of it, or its receipt) for ``header``'s group."""
    found = None
    for table in (batch_parts, receipts):
        c = table.c
        query = (
            select(c.batch_id)
            .where(
                c.shuffler_id == header.shuffler_id,
                c.channel_id == header.channel_id,
                c.crowd_id == header.crowd_id,
                c.epoch == header.epoch,
                c.batch_id != header.batch_id,
            )
            .limit(1)
        )
        found = found or conn.execute(query).scalar_one_or_none()
    return None if found is None else str(found)


def _known(conn: Connection, header: PartHeader) -> bool:
    """The part is stored, or its batch was accepted whole (before parts existed)."""
    p, r = batch_parts.c, receipts.c
    part = select(p.part).where(p.batch_id == header.batch_id, p.part == header.part)
    whole = select(r.batch_id).where(r.batch_id == header.batch_id)
    return any(conn.execute(q).first() is not None for q in (part, whole))


def _lock_batch(conn: Connection, header: PartHeader) -> None:
    """PostgreSQL: transaction-scoped advisory locks on the part's group (shuffler, channel,
    crowd, epoch), then on its batch (their first part's row does not exist yet, so a row lock
    cannot serve; every caller takes them in this order); SQLite has one writer anyway."""
    if conn.dialect.name == "postgresql":
        group = [header.shuffler_id, header.channel_id, header.crowd_id, header.epoch]
        for key in (["analyzer-group", *group], ["analyzer-batch", header.batch_id]):
            lock = db.lock_key(key)
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock})


_HEADER = tuple(
    batch_parts.c[name]
    for name in (
        "batch_id",
        "part",
        "parts",
        "shuffler_id",
        "channel_id",
        "crowd_id",
        "epoch",
        "n_contributions",
        "n_fragments",
    )
)


def _fold_part(
    conn: Connection,
    header: PartHeader,
    fold: Fold,
    steps: tuple[Complete, Merge, Charge],
    decrypted: tuple[int, Sequence[bytes], seen.SeenRecord, list[seen.Staged]],
    now: float,
) -> Folded | None:
    """:meth:`AnalyzerStore.fold_part` in its transaction; ``decrypted``: the fragments
    opened, their seal keys, the record and where to leave its staged part for after the
    commit."""
    p, o = batch_parts.c, open_batches.c
    n_opened, seal_keys, record, staged = decrypted
    part_key = (p.batch_id == header.batch_id, p.part == header.part, p.status == STORED)
    if conn.execute(_locked(conn, select(p.part).where(*part_key))).first() is None:
        return None
    repeated, part = record.check(conn, (header.channel_id, header.epoch), seal_keys)
    staged.append(part)
    row = conn.execute(
        _locked(
            conn,
            select(o.state, o.opened, o.n_fragments, o.invalid).where(
                o.batch_id == header.batch_id
            ),
        )
    ).first()
    state, invalid = fold(None if row is None else bytes(row.state), repeated)
    # Marked opened with its counts in one statement, under the row lock taken above while it
    # was still stored: the part counts once in the fragment ledger, whoever folds it.
    conn.execute(
        update(batch_parts)
        .where(*part_key)
        .values(status=OPENED, body=None, invalid=invalid, n_opened=n_opened)
    )
    opened = 1 + (0 if row is None else int(row.opened))
    fragments = header.n_fragments + (0 if row is None else int(row.n_fragments))
    invalid += 0 if row is None else int(row.invalid)
    if row is not None:
        conn.execute(delete(open_batches).where(o.batch_id == header.batch_id))
    if opened < header.parts:
        conn.execute(
            insert(open_batches).values(
                batch_id=header.batch_id,
                state=state,
                opened=opened,
                n_fragments=fragments,
                invalid=invalid,
            )
        )
        return Folded.PART
    _complete_batch(conn, header, state, (fragments, invalid), steps, now)
    return Folded.BATCH


def _complete_batch(
    conn: Connection,
    header: PartHeader,
    state: bytes,
    counts: tuple[int, int],
    steps: tuple[Complete, Merge, Charge],
    now: float,
) -> None:
    """A batch whose last part was just folded (``counts``: its fragments, invalid ones): its
    verified crowd, its receipt, and unless withheld its accumulator and epoch charge."""
    (fragments, invalid), (complete, merge, charge) = counts, steps
    done = complete(state, fragments - invalid, invalid)
    receipt = BatchReceipt(
        batch_id=header.batch_id,
        shuffler_id=header.shuffler_id,
        channel_id=header.channel_id,
        crowd_id=header.crowd_id,
        epoch=header.epoch,
        n_contributions=header.n_contributions,
        n_fragments=fragments,
        n_verified=done.verified,
    )
    if not done.released:
        conn.execute(
            insert(receipts).values(
                **asdict(receipt), invalid=invalid, received_at=now, withheld=True
            )
        )
        return
    _complete(conn, receipt, invalid, merge(_accumulator(conn, receipt), done.state), now)
    _charge(conn, receipt, charge, now)


def _accumulator(conn: Connection, receipt: BatchReceipt) -> bytes | None:
    a = accumulators.c
    query = select(a.state).where(*_accumulator_key(receipt))
    state = conn.execute(_locked(conn, query)).scalar_one_or_none()
    return None if state is None else bytes(state)


def _accumulator_key(receipt: BatchReceipt) -> tuple[ColumnElement[bool], ...]:
    a = accumulators.c
    return (
        a.channel_id == receipt.channel_id,
        a.crowd_id == receipt.crowd_id,
        a.epoch == receipt.epoch,
        a.shuffler_id == receipt.shuffler_id,
    )


def _complete(
    conn: Connection, receipt: BatchReceipt, invalid: int, state: bytes, now: float
) -> None:
    """A complete batch joins its accumulator and gets its receipt (one transaction)."""
    key = _accumulator_key(receipt)
    conn.execute(insert(receipts).values(**asdict(receipt), invalid=invalid, received_at=now))
    batches = conn.execute(select(accumulators.c.batches).where(*key)).scalar_one_or_none()
    if batches is None:
        conn.execute(
            insert(accumulators).values(
                channel_id=receipt.channel_id,
                crowd_id=receipt.crowd_id,
                epoch=receipt.epoch,
                shuffler_id=receipt.shuffler_id,
                state=state,
                batches=1,
            )
        )
    else:
        conn.execute(update(accumulators).where(*key).values(state=state, batches=batches + 1))


def _received(
    conn: Connection, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
) -> ReceivedRange:
    a, r = accumulators.c, receipts.c
    rows = conn.execute(
        select(a.epoch, a.shuffler_id, a.state).where(
            *_in_range(accumulators, channel_id, crowd_id, epoch_from, epoch_to)
        )
    ).all()
    verified = func.coalesce(r.n_verified, r.n_contributions)
    batches = conn.execute(
        select(r.epoch, r.shuffler_id, verified).where(
            *_in_range(receipts, channel_id, crowd_id, epoch_from, epoch_to), ~r.withheld
        )
    ).all()
    sizes: dict[tuple[int, str], list[int]] = {}
    for epoch, shuffler_id, n in batches:
        sizes.setdefault((int(epoch), shuffler_id), []).append(int(n))
    return ReceivedRange(
        [StoredState(int(e), s, bytes(state)) for e, s, state in rows],
        {key: tuple(ns) for key, ns in sizes.items()},
    )


def _charge(conn: Connection, receipt: BatchReceipt, charge: Charge, now: float) -> None:
    """Rewrite the epoch's ledger row from everything received in it (the crowds change as
    batches arrive; the row is one per epoch, never one per batch or query).

    The (channel, crowd, epoch) lock comes first and the read after it, in this transaction: a
    concurrent writer of the same epoch (another analyzer process on PostgreSQL) waits here
    until this one commits, then reads this batch too (READ COMMITTED reads what committed
    before each statement), so the last rewrite always covers every batch of the epoch.
    """
    epoch = receipt.epoch
    _lock_epoch(conn, receipt.channel_id, receipt.crowd_id, epoch)
    received = _received(conn, receipt.channel_id, receipt.crowd_id, epoch, epoch)
    certificate = charge(received)
    if certificate is None:
        return
    c = epoch_charges.c
    key = (
        c.channel_id == receipt.channel_id,
        c.crowd_id == receipt.crowd_id,
        c.epoch == epoch,
    )
    values = {
        "certificate": certificate,
        "batches": sum(len(ns) for ns in received.batch_sizes.values()),
        "charged_at": now,
    }
    if conn.execute(select(c.epoch).where(*key)).first() is None:
        conn.execute(
            insert(epoch_charges).values(
                channel_id=receipt.channel_id, crowd_id=receipt.crowd_id, epoch=epoch, **values
            )
        )
    else:
        conn.execute(update(epoch_charges).where(*key).values(**values))


def _lock_epoch(conn: Connection, channel_id: str, crowd_id: str, epoch: int) -> None:
    """PostgreSQL: a transaction-scoped advisory lock on the (channel, crowd, epoch) key (the
    ``epoch_charges`` row may not exist yet, so a row lock cannot serve). SQLite: the
    transaction already holds the database's single write lock (it wrote the part first)."""
    if conn.dialect.name != "postgresql":
        return
    key = db.lock_key([channel_id, crowd_id, epoch])
    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


def _locked(conn: Connection, query: Select[Any]) -> Select[Any]:
    # PostgreSQL: lock the accumulator row so concurrent batches fold in one after another.
    # SQLite has no row locks; its single writer (and the store's lock) serializes instead.
    return query.with_for_update() if conn.dialect.name == "postgresql" else query


def _in_range(
    table: Table, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
) -> tuple[ColumnElement[bool], ...]:
    c = table.c
    return (
        c.channel_id == channel_id,
        c.crowd_id == crowd_id,
        c.epoch.between(epoch_from, epoch_to),
    )


class CompleteEpoch(NamedTuple):
    """A (channel, epoch)'s complete batches: how many, how many withheld, the crowd they
    claim and the one they verify, and their fragments that failed to open or parse."""

    batches: int = 0
    withheld: int = 0
    claimed: int = 0
    verified: int = 0
    invalid: int = 0


class IncompleteEpoch(NamedTuple):
    """A (channel, epoch)'s incomplete batches: how many, the crowd they claim, and their
    parts quarantined."""

    batches: int = 0
    claimed: int = 0
    quarantined: int = 0


@dataclass(frozen=True, slots=True)
class EpochHealth:
    """What a channel's owner sees of one (channel, epoch) at the analyzer, all of it about
    batches received, so about groups the shufflers released: ``received`` is the crowd every
    batch claims (summed over shufflers, complete or not), ``verified`` the crowd the complete
    ones verify (withheld ones too), ``fragments_invalid`` the fragments of complete batches
    that failed to open or parse (chaff), ``releases`` the published releases whose epoch range
    includes the epoch."""

    channel_id: str
    epoch: int
    received: int
    verified: int
    batches_complete: int
    batches_withheld: int
    batches_incomplete: int
    parts_quarantined: int
    fragments_invalid: int
    releases: int


def _epoch_health(
    key: tuple[str, int], complete: CompleteEpoch, incomplete: IncompleteEpoch, releases: int
) -> EpochHealth:
    return EpochHealth(
        channel_id=key[0],
        epoch=key[1],
        received=complete.claimed + incomplete.claimed,
        verified=complete.verified,
        batches_complete=complete.batches,
        batches_withheld=complete.withheld,
        batches_incomplete=incomplete.batches,
        parts_quarantined=incomplete.quarantined,
        fragments_invalid=complete.invalid,
        releases=releases,
    )


def _read_snapshot(conn: Connection) -> None:
    """Make every read of ``conn`` until it closes see one snapshot of the database (SQLite:
    a read transaction, WAL; PostgreSQL: REPEATABLE READ)."""
    sqlite = conn.dialect.name == "sqlite"
    conn.exec_driver_sql("BEGIN" if sqlite else "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")


def _complete_epochs(conn: Connection, epochs: int) -> dict[tuple[str, int], CompleteEpoch]:
    """Each channel's ``epochs`` newest epochs with a receipt, and their complete batches (a
    withheld batch, whose verified crowd is below ``min_crowd``, only in the counts of batches:
    nothing below the crowd threshold is shown)."""
    r = receipts.c
    newest = func.row_number().over(partition_by=r.channel_id, order_by=r.epoch.desc())
    per_epoch = (
        select(
            r.channel_id,
            r.epoch,
            func.count().label("batches"),
            func.sum(case((r.withheld, 1), else_=0)).label("withheld"),
            func.sum(r.n_contributions).label("claimed"),
            # a withheld batch's verified crowd is below min_crowd: it shows only as a count
            func.sum(
                case((r.withheld, 0), else_=func.coalesce(r.n_verified, r.n_contributions))
            ).label("verified"),
            func.sum(case((r.withheld, 0), else_=r.invalid)).label("invalid"),
            newest.label("newest"),
        )
        .group_by(r.channel_id, r.epoch)
        .subquery()
    )
    s = per_epoch.c
    query = select(s.channel_id, s.epoch, s.batches, s.withheld, s.claimed, s.verified, s.invalid)
    return {
        (row.channel_id, int(row.epoch)): CompleteEpoch(
            batches=int(row.batches),
            withheld=int(row.withheld),
            claimed=int(row.claimed),
            verified=int(row.verified),
            invalid=int(row.invalid),
        )
        for row in conn.execute(query.where(s.newest <= epochs))
    }


def _incomplete_epochs(conn: Connection) -> dict[tuple[str, int], IncompleteEpoch]:
    """Every (channel, epoch) with an incomplete batch: a part waiting or quarantined (by the
    status index), or a batch open with some parts opened and others still to come."""
    p = batch_parts.c
    columns = select(p.batch_id, p.part, p.channel_id, p.epoch, p.n_contributions)
    # ``status`` is filtered by its index, never read: on SQLite it lies after a stored part's
    # ~4 MB body, and reading it walks the body's overflow pages; an opened part's body is NULL.
    queries = {
        STORED: columns.where(p.status == STORED),
        QUARANTINED: columns.where(p.status == QUARANTINED),
        OPENED: columns.where(p.batch_id.in_(select(open_batches.c.batch_id)), p.body.is_(None)),
    }
    parts = {
        (row[0], row[1]): (*row, status)
        for status, query in queries.items()
        for row in conn.execute(query)
    }
    batches: dict[tuple[str, int], dict[str, int]] = {}
    quarantined: dict[tuple[str, int], int] = {}
    for batch_id, _, channel, epoch, n, status in parts.values():
        key = (channel, int(epoch))
        batches.setdefault(key, {})[batch_id] = int(n)
        quarantined[key] = quarantined.get(key, 0) + (status == QUARANTINED)
    return {
        key: IncompleteEpoch(len(claims), sum(claims.values()), quarantined[key])
        for key, claims in batches.items()
    }


def _newest_keys(keys: Collection[tuple[str, int]], epochs: int) -> list[tuple[str, int]]:
    """Each channel's ``epochs`` newest of ``keys``, by channel then newest first."""
    ordered = sorted(keys, key=lambda key: (key[0], -key[1]))
    by_channel = itertools.groupby(ordered, key=lambda key: key[0])
    return [key for _, group in by_channel for key in itertools.islice(group, epochs)]


def _releases_over(conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """How many published releases cover each (channel, epoch) of ``keys`` (a release over
    epochs ``[from, to]`` covers each of them)."""
    lowest: dict[str, int] = {}
    for channel, epoch in keys:
        lowest[channel] = min(epoch, lowest.get(channel, epoch))
    r = releases.c
    ranges = [
        (channel, int(first), int(last))
        for low_channel, low in lowest.items()
        for channel, first, last in conn.execute(
            select(r.channel_id, r.epoch_from, r.epoch_to).where(
                r.channel_id == low_channel, r.epoch_to >= low
            )
        )
    ]
    return {
        (channel, epoch): sum(c == channel and lo <= epoch <= hi for c, lo, hi in ranges)
        for channel, epoch in keys
    }
