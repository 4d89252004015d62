"""The shuffler's one-transaction queries: functions that take the caller's ``conn`` (or a row)
and run their statements inside its transaction, dialect-neutral (SQLAlchemy Core over
:mod:`shuffler.tables`).

:class:`shuffler.store.ContributionStore` opens the transactions (:func:`runtime.db.run_tx`) and
sequences these steps; the dialects' own statements are in :mod:`shuffler.store_backends`. Why
the steps are safe together: docs/shuffler.md, "Storage, locking and durability".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import (
    Select,
    Table,
    case,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import Connection

from common.terms import ChannelTerms
from common.wire import ChannelPolicy
from shuffler import tables
from shuffler.batcher import Deletion, GroupStatus, ReleasedBatch
from shuffler.records import Conflict, GroupKey, PartKey, Pending, SealedPart, pack_fragments

#: The columns of a contribution row (:data:`Row`), in the order of the group commit's insert.
COLUMNS = (
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
#: Where a :data:`Row` holds its nonce, receipt, client, channel and epoch.
NONCE, RECEIPT = COLUMNS.index("nonce"), COLUMNS.index("receipt")
CLIENT = COLUMNS.index("client_id")
CHANNEL, EPOCH = COLUMNS.index("channel_id"), COLUMNS.index("epoch")
_IDS_PER_DELETE = 10_000
#: Group keys looked up in the ``groups`` table per query.
_KEYS_PER_QUERY = 200
#: Rows of a group locked (and their ids and fragment counts read) per query.
_LOCK_PAGE = 50_000

Row = tuple[Any, ...]
Ids = npt.NDArray[np.int64]
#: What one group-commit transaction found: (revoked clients among the rows, latest closed
#: epoch of their channels, receipts of the rows that landed, nonces that were already taken).
Landings = tuple[set[str], dict[str, int], set[str], set[bytes]]


def contribution_row(pending: Pending, receipt: str) -> Row:
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


def stage_part(conn: Connection, sealed: SealedPart, now: float) -> None:
    """Insert one signed part ``staged``, with its body
    (:meth:`shuffler.store.ContributionStore.stage_parts`)."""
    conn.execute(insert(tables.batch_parts).values(**_part_row(sealed, now)))
    conn.execute(
        insert(tables.part_bodies).values(
            batch_id=sealed.batch_id, part=sealed.part, body=sealed.body
        )
    )


def stale_batches(
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


def lock_parts(conn: Connection, batch_ids: list[str]) -> None:
    """Lock every part of these batches until the transaction ends (PostgreSQL)."""
    p = tables.batch_parts.c
    conn.execute(select(p.batch_id).where(p.batch_id.in_(batch_ids)).with_for_update()).all()


def delete_orphans(conn: Connection, before: float) -> None:
    """Delete staged parts older than ``before`` (an evaluation that crashed mid-staging)."""
    p = tables.batch_parts.c
    delete_parts(conn, p.status == "staged", p.created_at < before)


def delete_parts(conn: Connection, *where: Any) -> None:
    """Delete the parts matching ``where`` (conditions on ``batch_parts``) and their bodies."""
    p, body = tables.batch_parts.c, tables.part_bodies.c
    matching = exists().where(p.batch_id == body.batch_id, p.part == body.part, *where)
    conn.execute(delete(tables.part_bodies).where(matching))
    conn.execute(delete(tables.batch_parts).where(*where))


def landing(
    row: Row, landed: set[str], taken: set[bytes], revoked: set[str], closed: dict[str, int]
) -> str | Conflict:
    if row[CLIENT] in revoked:
        return Conflict.REVOKED
    if _late(row, closed):
        return Conflict.CLOSED
    if row[RECEIPT] in landed:
        return str(row[RECEIPT])
    return Conflict.REPLAYED_NONCE if row[NONCE] in taken else Conflict.OVER_QUOTA


def nonces_among(conn: Connection, nonces: list[bytes]) -> set[bytes]:
    """Which of ``nonces`` are stored (after the insert committed: a nonce it hit is in the
    table, or in an evaluated group's batch since, and then reads as over quota; both 409)."""
    c = tables.contributions.c
    return set(conn.execute(select(c.nonce).where(c.nonce.in_(nonces))).scalars())


def closed_among(conn: Connection) -> dict[str, int]:
    """The latest closed epoch of each channel. An admin close answered by one replica of the
    trust domain persists it, and from then on no replica may acknowledge a contribution for
    that epoch (the group is evaluated once; a later one would only be deleted as late, after
    its 202): the insert reads it in its own transaction
    (:func:`shuffler.store_backends._checks_among`)."""
    e = tables.closed_epochs.c
    query = select(e.channel_id, func.max(e.epoch)).group_by(e.channel_id)
    return {channel: int(epoch) for channel, epoch in conn.execute(query)}


def _late(row: Row, closed: dict[str, int]) -> bool:
    return bool(row[EPOCH] <= closed.get(row[CHANNEL], -1))


def admitted(rows: list[Row], revoked: set[str], closed: dict[str, int]) -> list[Row]:
    """The rows neither from a revoked client nor for a closed epoch."""
    return [row for row in rows if row[CLIENT] not in revoked and not _late(row, closed)]


def refused_nonces(
    rows: list[Row], revoked: set[str], closed: dict[str, int], landed: set[str]
) -> list[bytes]:
    """The nonces of the admitted rows that did not land: a unique constraint refused them."""
    return [r[NONCE] for r in admitted(rows, revoked, closed) if r[RECEIPT] not in landed]


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


def waiting_groups(conn: Connection, evaluated: bool) -> dict[GroupKey, int]:
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


def group_keys(conn: Connection, evaluated: bool) -> list[GroupKey]:
    """The groups of :func:`waiting_groups` without their counts, found by skipping through
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


def unheld(key: GroupKey) -> list[Any]:
    """The group's contributions that are not held: waiting, or dead once it is evaluated."""
    return [*_group_filter(key, tables.contributions), tables.contributions.c.held_part.is_(None)]


def dead_ids(conn: Connection, key: GroupKey, limit: int) -> list[int]:
    query = select(tables.contributions.c.id).where(*unheld(key)).limit(limit)
    return list(conn.execute(query).scalars())


def expired(conn: Connection, cutoff: float) -> list[int]:
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


def group_rows(conn: Connection, key: GroupKey, lock: bool) -> tuple[Ids, Ids]:
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
            .where(*unheld(key), c.id > last)
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


def purge_late(conn: Connection, ids: Ids, now: float) -> None:
    """Delete contributions that reached an already evaluated group, and record them."""
    removed = delete_ids(conn, ids.tolist())
    if removed:
        conn.execute(
            insert(tables.purges).values(reason="late", contributions=removed, purged_at=now)
        )


class VanishedError(RuntimeError):
    """A contribution read when the evaluation began was deleted before its blob was read."""


def times_evaluated(conn: Connection, key: GroupKey) -> int:
    """How many times the group was evaluated (0 or 1: a group is evaluated once, whole)."""
    g = tables.groups
    return int(
        conn.execute(select(func.count()).select_from(g).where(*_group_filter(key, g))).scalar_one()
    )


def apply_outcome(
    conn: Connection, key: GroupKey, part: int, ids: Ids, deletion: Deletion, now: float
) -> None:
    """Store Algorithm 3's outcome: hold the group's contributions, or record the group, whose
    row makes its contributions dead (the survivors' fragments are in the batch already
    stored; the sweep deletes the rows, :meth:`shuffler.store.ContributionStore.sweep`)."""
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


def publish(conn: Connection, key: GroupKey, batch: ReleasedBatch, now: float) -> None:
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


def part_filter(key: PartKey) -> list[Any]:
    p = tables.batch_parts.c
    return [p.batch_id == key.batch_id, p.part == key.part]


def unleased(now: float) -> Any:
    lease = tables.batch_parts.c.lease_until
    return or_(lease.is_(None), lease < now)


def delete_ids(conn: Connection, ids: Sequence[int]) -> int:
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


def newest_epochs(epochs: int) -> Select[Any]:
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


def forwarded_by_epoch(
    conn: Connection, keys: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], int]:
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


def followed_policy(stored: dict[str, Any]) -> ChannelPolicy:
    """A followed channel's row: whole privacy terms when it names a mechanism."""
    kind = ChannelTerms if "mechanism" in stored else ChannelPolicy
    return kind.model_validate(stored)
