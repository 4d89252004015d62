"""The analyzer's one-transaction queries: functions that take the caller's ``conn`` and run
their statements inside its transaction (SQLAlchemy Core over :mod:`analyzer.tables`).

:class:`analyzer.store.AnalyzerStore` opens the transactions (:func:`runtime.db.run_tx`); these
are their steps: a part's stored siblings and rival batch, folding an opened part into its
batch and completing the batch (receipt, accumulator, the epoch's charge in the privacy
ledger), the range a release reads, and an epoch's health. Where the dialects differ (advisory
and row locks on PostgreSQL only) it says so. Why: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import asdict
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    case,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection

from analyzer import seen
from analyzer.records import (
    BatchReceipt,
    Charge,
    CompleteEpoch,
    EpochHealth,
    Folded,
    Group,
    IncompleteEpoch,
    PartFolding,
    PartHeader,
    ReceivedRange,
    StoredState,
)
from analyzer.tables import (
    OPENED,
    QUARANTINED,
    STORED,
    accumulators,
    batch_parts,
    epoch_charges,
    epoch_closures,
    open_batches,
    receipts,
    releases,
)
from runtime import db

#: A part's header columns, in :class:`~analyzer.records.PartHeader` order.
HEADER_COLUMNS = tuple(
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


def stored_parts(conn: Connection, batch_id: str) -> list[PartHeader]:
    p = batch_parts.c
    query = select(*HEADER_COLUMNS).where(p.batch_id == batch_id).order_by(p.part)
    return [PartHeader(*row) for row in conn.execute(query)]


def rival_batch(conn: Connection, header: PartHeader) -> str | None:
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


def part_known(conn: Connection, header: PartHeader) -> bool:
    """The part is stored, or its batch was accepted whole (before parts existed)."""
    p, r = batch_parts.c, receipts.c
    part = select(p.part).where(p.batch_id == header.batch_id, p.part == header.part)
    whole = select(r.batch_id).where(r.batch_id == header.batch_id)
    return any(conn.execute(q).first() is not None for q in (part, whole))


def lock_batch(conn: Connection, header: PartHeader) -> None:
    """PostgreSQL: transaction-scoped advisory locks on the part's group (shuffler, channel,
    crowd, epoch), then on its batch (their first part's row does not exist yet, so a row lock
    cannot serve; every caller takes them in this order); SQLite has one writer anyway."""
    if conn.dialect.name == "postgresql":
        group = [header.shuffler_id, header.channel_id, header.crowd_id, header.epoch]
        for key in (["analyzer-group", *group], ["analyzer-batch", header.batch_id]):
            lock = db.lock_key(key)
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock})


def fold_part(
    conn: Connection,
    header: PartHeader,
    folding: PartFolding,
    decrypted: tuple[int, Sequence[bytes], seen.SeenRecord],
    now: float,
) -> tuple[Folded, seen.Staged] | None:
    """:meth:`analyzer.store.AnalyzerStore.fold_part` in its transaction; ``decrypted``: the
    fragments opened, their seal keys and the record they are checked against. Returns what
    was folded and the record's staged part, for after the commit; None if the part is no
    longer waiting."""
    p, o = batch_parts.c, open_batches.c
    n_opened, seal_keys, record = decrypted
    part_key = (p.batch_id == header.batch_id, p.part == header.part, p.status == STORED)
    if conn.execute(locked(conn, select(p.part).where(*part_key))).first() is None:
        return None
    repeated, staged = record.check(conn, (header.channel_id, header.epoch), seal_keys)
    row = conn.execute(
        locked(
            conn,
            select(o.state, o.opened, o.n_fragments, o.invalid).where(
                o.batch_id == header.batch_id
            ),
        )
    ).first()
    state, invalid = folding.fold(None if row is None else bytes(row.state), repeated)
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
        return Folded.PART, staged
    _complete_batch(conn, header, state, (fragments, invalid), folding, now)
    return Folded.BATCH, staged


def _complete_batch(
    conn: Connection,
    header: PartHeader,
    state: bytes,
    counts: tuple[int, int],
    folding: PartFolding,
    now: float,
) -> None:
    """A batch whose last part was just folded (``counts``: its fragments, invalid ones): its
    verified crowd, its receipt, and unless withheld its accumulator and epoch charge."""
    fragments, invalid = counts
    done = folding.complete(state, fragments - invalid, invalid)
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
    merged = folding.merge(_accumulator(conn, receipt), done.state)
    _complete(conn, receipt, invalid, merged, now)
    charge_epoch(conn, receipt, folding.charge, now)


def _accumulator(conn: Connection, receipt: BatchReceipt) -> bytes | None:
    a = accumulators.c
    query = select(a.state).where(*_accumulator_key(receipt))
    state = conn.execute(locked(conn, query)).scalar_one_or_none()
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


def received_range(
    conn: Connection, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
) -> ReceivedRange:
    a, r = accumulators.c, receipts.c
    rows = conn.execute(
        select(a.epoch, a.shuffler_id, a.state).where(
            *in_range(accumulators, channel_id, crowd_id, epoch_from, epoch_to)
        )
    ).all()
    verified = func.coalesce(r.n_verified, r.n_contributions)
    batches = conn.execute(
        select(r.epoch, r.shuffler_id, verified).where(
            *in_range(receipts, channel_id, crowd_id, epoch_from, epoch_to), ~r.withheld
        )
    ).all()
    sizes: dict[tuple[int, str], list[int]] = {}
    for epoch, shuffler_id, n in batches:
        sizes.setdefault((int(epoch), shuffler_id), []).append(int(n))
    return ReceivedRange(
        [StoredState(int(e), s, bytes(state)) for e, s, state in rows],
        {key: tuple(ns) for key, ns in sizes.items()},
    )


def charge_epoch(conn: Connection, receipt: BatchReceipt, charge: Charge, now: float) -> None:
    """Rewrite the epoch's ledger row from everything received in it (the crowds change as
    batches arrive; the row is one per epoch, never one per batch or query).

    The (channel, crowd, epoch) lock comes first and the read after it, in this transaction: a
    concurrent writer of the same epoch (another analyzer process on PostgreSQL) waits here
    until this one commits, then reads this batch too (READ COMMITTED reads what committed
    before each statement), so the last rewrite always covers every batch of the epoch.
    """
    epoch = receipt.epoch
    lock_epoch(conn, receipt.channel_id, receipt.crowd_id, epoch)
    received = received_range(conn, receipt.channel_id, receipt.crowd_id, epoch, epoch)
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


def lock_epoch(conn: Connection, channel_id: str, crowd_id: str, epoch: int) -> None:
    """PostgreSQL: a transaction-scoped advisory lock on the (channel, crowd, epoch) key (the
    ``epoch_charges`` row may not exist yet, so a row lock cannot serve). SQLite: the
    transaction already holds the database's single write lock (it wrote the part first)."""
    if conn.dialect.name != "postgresql":
        return
    key = db.lock_key([channel_id, crowd_id, epoch])
    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


def locked(conn: Connection, query: Select[Any]) -> Select[Any]:
    # PostgreSQL: lock the accumulator row so concurrent batches fold in one after another.
    # SQLite has no row locks; its single writer (and the store's lock) serializes instead.
    return query.with_for_update() if conn.dialect.name == "postgresql" else query


def in_range(
    table: Table, channel_id: str, crowd_id: str, epoch_from: int, epoch_to: int
) -> tuple[ColumnElement[bool], ...]:
    c = table.c
    return (
        c.channel_id == channel_id,
        c.crowd_id == crowd_id,
        c.epoch.between(epoch_from, epoch_to),
    )


def epoch_health(
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


def read_snapshot(conn: Connection) -> None:
    """Make every read of ``conn`` until it closes see one snapshot of the database (SQLite:
    a read transaction, WAL; PostgreSQL: REPEATABLE READ)."""
    sqlite = conn.dialect.name == "sqlite"
    conn.exec_driver_sql("BEGIN" if sqlite else "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")


def complete_epochs(conn: Connection, epochs: int) -> dict[tuple[str, int], CompleteEpoch]:
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


def incomplete_epochs(conn: Connection) -> dict[tuple[str, int], IncompleteEpoch]:
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


def newest_keys(keys: Collection[tuple[str, int]], epochs: int) -> list[tuple[str, int]]:
    """Each channel's ``epochs`` newest of ``keys``, by channel then newest first."""
    ordered = sorted(keys, key=lambda key: (key[0], -key[1]))
    by_channel = itertools.groupby(ordered, key=lambda key: key[0])
    return [key for _, group in by_channel for key in itertools.islice(group, epochs)]


def releases_over(conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
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


def unclosed_groups(conn: Connection, arriving_after: float) -> list[Group]:
    """:meth:`analyzer.store.AnalyzerStore.open_groups` in its connection: groups with a batch
    received and no closure, less those with a part waiting for the opener or an incomplete
    batch whose last part arrived after ``arriving_after``."""
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
    found = {Group(ch, cr, int(e)) for q in queries for ch, cr, e in conn.execute(q)}
    busy = {Group(ch, cr, int(e)) for q in (waiting, arriving) for ch, cr, e in conn.execute(q)}
    return sorted(found - busy)
