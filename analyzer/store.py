"""The analyzer's storage: receipts, accumulators and releases behind one interface.

:class:`AnalyzerStore` opens every transaction (:func:`runtime.db.run_tx`) and sequences its
steps; the tables are :mod:`analyzer.tables`, the values read and written
:mod:`analyzer.records`, and the queries each step runs inside one transaction
:mod:`analyzer.store_queries`. Reads write nothing. What depends on the database dialect stays
in these modules (PostgreSQL's advisory and row locks, its snapshot statement).

What each table holds and why: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict

from sqlalchemy import case, delete, func, insert, select, text, true, tuple_, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from analyzer import seen
from analyzer.errors import StorageConflictError
from analyzer.records import (
    BatchProgress,
    BatchReceipt,
    ChannelLogRow,
    Charge,
    CompleteEpoch,
    DeliveredBatch,
    EpochHealth,
    Folded,
    FragmentCounts,
    Group,
    IncompleteEpoch,
    PartFolding,
    PartHeader,
    PartStatus,
    ReceivedRange,
    StoredBatch,
    StoredCharge,
    StoredRelease,
)
from analyzer.store_queries import (
    HEADER_COLUMNS,
    charge_epoch,
    complete_epochs,
    epoch_health,
    fold_part,
    in_range,
    incomplete_epochs,
    lock_batch,
    lock_epoch,
    locked,
    newest_keys,
    part_known,
    read_snapshot,
    received_range,
    releases_over,
    rival_batch,
    stored_parts,
    unclosed_groups,
)
from analyzer.tables import (
    ADD,
    OPENED,
    QUARANTINED,
    STORED,
    accumulators,
    batch_parts,
    channel_changes,
    epoch_charges,
    epoch_closures,
    open_batches,
    receipts,
    releases,
    shuffler_descriptors,
)
from common.wire import Bound, ReleaseBody
from runtime import db
from runtime.failpoints import failpoint

#: What tests and tools import from here: the store, and the values and tables they check it by
#: (each defined in :mod:`analyzer.records` or :mod:`analyzer.tables`).
__all__ = [
    "ADD",
    "PENDING_PAGE",
    "AnalyzerStore",
    "BatchProgress",
    "PartHeader",
    "PartStatus",
    "ReceivedRange",
    "StoredBatch",
    "batch_parts",
    "channel_changes",
    "epoch_charges",
    "receipts",
]

#: Longest ``last_error`` kept for a failed opening.
ERROR_CHARS = 2000
#: Attempts to store one batch when concurrent writers create the same accumulator row.
STORE_ATTEMPTS = 5
#: Stored parts the opener reads per query (a page of headers, never their bodies).
PENDING_PAGE = 100


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
            return stored_parts(conn, batch_id)

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
            lock_batch(conn, header)
            if part_known(conn, header):
                return False
            check(StoredBatch(stored_parts(conn, header.batch_id), rival_batch(conn, header)))
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
            return part_known(conn, header)

    def pending_parts(
        self, limit: int = PENDING_PAGE, after: PartHeader | None = None
    ) -> list[PartHeader]:
        """Stored parts waiting for the opener, oldest first (what it resumes after a crash);
        ``after`` pages on past a part (keyset on (``received_at``, ``batch_id``, ``part``)), so
        parts the opener skips never hide the ones behind them."""
        p = batch_parts.c
        order = (p.received_at, p.batch_id, p.part)
        query = select(*HEADER_COLUMNS).where(p.status == STORED).order_by(*order).limit(limit)
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
            before = conn.execute(locked(conn, select(p.attempts).where(*key))).scalar()
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
        folding: PartFolding,
        *,
        n_opened: int,
        seal_keys: Sequence[bytes] = (),
    ) -> Folded | None:
        """Fold an opened part (``n_opened`` of its fragments decrypted, ``seal_keys`` theirs in
        order) into its batch's statistics and mark it opened with its fragment counts, in one
        transaction: its fragments counted before in the epoch are recorded there too, so a
        repeat is left out exactly once whatever crashes or retries (:mod:`analyzer.seen`);
        when it is the batch's last part, the batch gets its verified crowd (``folding``'s
        complete), joins its accumulator (merge), gets its receipt and its epoch is recharged
        (charge) in the same transaction (so a batch counts once, whole, or not at all).
        Returns None if the part is no longer waiting (opened by another opener, or
        quarantined).

        Raises:
            StorageConflictError: if concurrent writers kept colliding.
        """

        def fold_in(conn: Connection) -> tuple[Folded, seen.Staged] | None:
            decrypted = (n_opened, seal_keys, self.seen)
            folded = fold_part(conn, header, folding, decrypted, self.clock())
            if folded is not None and folded[0] is Folded.PART:
                failpoint("analyzer.fold.part_before_commit")
            elif folded is not None:
                failpoint("analyzer.fold.batch_before_commit")
            return folded

        try:
            # An IntegrityError is a concurrent writer's row: the next attempt reads it.
            folded = db.run_tx(
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
        if folded is None:
            return None
        failpoint("analyzer.fold.after_commit")
        self.seen.commit(folded[1])  # memory follows the record only once its rows committed
        return folded[0]

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
            .where(*in_range(batch_parts, channel_id, crowd_id, epoch_from, epoch_to))
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
            lambda conn: charge_epoch(conn, key, charge, self.clock()),
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
            return received_range(conn, channel_id, crowd_id, epoch_from, epoch_to)

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
            read_snapshot(conn)
            complete = complete_epochs(conn, epochs)
            incomplete = incomplete_epochs(conn)
            keys = newest_keys(set(complete) | set(incomplete), epochs)
            published = releases_over(conn, keys)
        return [
            epoch_health(
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
        ).where(*in_range(receipts, channel_id, crowd_id, epoch_from, epoch_to))
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
            *in_range(epoch_closures, channel_id, crowd_id, epoch_from, epoch_to)
        )
        with self.engine.connect() as conn:
            return {int(e): frozenset(json.loads(s)) for e, s in conn.execute(query)}

    def open_groups(self, arriving_after: float) -> list[Group]:
        """Groups with a batch received (complete or not) and no closure, leaving out those
        with a part still waiting for the opener, or an incomplete batch whose last part
        arrived after ``arriving_after`` (both arrived in time: closing now would leave them
        out only because delivering or opening a batch takes a while)."""
        with self.engine.connect() as conn:
            return unclosed_groups(conn, arriving_after)

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
            lock_epoch(conn, *group)
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
