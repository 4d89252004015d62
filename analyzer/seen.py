"""The record that counts each sealed fragment once per (channel, epoch), cheap at 10^6
contributions an epoch.

A fragment's record key is the first 8 bytes of its seal key (:func:`common.envelope.seal_key`,
the start of its HPKE ``enc``) read as a big-endian uint64. Honest devices' X25519 encs are
uniformly random, so a forger cannot aim a fragment at an honest one without a 2^64 search,
and an accidental collision among the ~8.4·10^6 honest fragments of a 10^6-contribution epoch
has probability ~n²/2^65 ≈ 2·10^-6: it makes one honest fragment count as repeated, a smaller
verified crowd, which is the safe direction for the certified ε (docs/protocol-notes.md).

Durably, one ``seen_parts`` row per folded part holds the sorted keys that fold counted, and
one ``seen_epochs`` row per (channel, epoch) numbers them (``seq``) and serializes the folds of
the epoch across crowds and analyzer workers (its ``UPDATE`` is the row lock). In memory, each
process keeps per recent epoch the sorted keys counted so far and the highest ``seq`` merged;
a fold reads only the rows written since, and merges its own part after its commit, so the
memory is never ahead of the database (a rollback leaves it behind, and the next fold reads
the rows it missed).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    delete,
    func,
    insert,
    select,
    update,
)

Keys = npt.NDArray[np.uint64]

#: Bytes of the seal key a record key keeps (a uint64).
RECORD_KEY_SIZE = 8
#: (channel, epoch) key sets each process keeps in memory (least recently folded dropped
#: first, reloaded from ``seen_parts`` when needed): ~67 MB per 10^6-contribution epoch.
CACHED_EPOCHS = 4

metadata = MetaData()

#: Per (channel, epoch): the last ``seq`` given to a folded part, and a random generation
#: that changes when retention drops the epoch and a late part starts it again.
seen_epochs = Table(
    "seen_epochs",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("generation", LargeBinary(16), nullable=False),
    Column("seq", Integer, nullable=False),
)

#: Per folded part: the sorted big-endian uint64 record keys of the fragments it counted.
seen_parts = Table(
    "seen_parts",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("keys", LargeBinary, nullable=False),
)


def record_keys(seal_keys: Sequence[bytes]) -> Keys:
    """The record keys (uint64) of ``seal_keys``, in order."""
    joined = b"".join(key[:RECORD_KEY_SIZE] for key in seal_keys)
    return np.frombuffer(joined, dtype=">u8").astype(np.uint64)


def _merge(counted: Keys, fresh: Keys) -> Keys:
    """Sorted ``counted`` with the sorted ``fresh`` (disjoint from it) inserted: one copy."""
    return np.insert(counted, np.searchsorted(counted, fresh), fresh)


def _repeats(counted: Keys, keys: Keys) -> tuple[list[int], Keys]:
    """Positions in ``keys`` already in ``counted`` or earlier in ``keys``, and the sorted
    distinct keys that are new."""
    distinct, first = np.unique(keys, return_index=True)
    at = np.searchsorted(counted, distinct)
    known = at < len(counted)
    known[known] = counted[at[known]] == distinct[known]
    keep = np.zeros(len(keys), dtype=bool)
    keep[first[~known]] = True
    return [int(i) for i in np.flatnonzero(~keep)], distinct[~known]


@dataclass(frozen=True)
class _Epoch:
    generation: bytes
    seq: int
    counted: Keys


@dataclass(frozen=True)
class Staged:
    """A fold's part recorded in its (uncommitted) transaction: merged into memory by
    :meth:`SeenRecord.commit` once the transaction committed."""

    group: tuple[str, int]
    generation: bytes
    seq: int
    counted: Keys


class SeenRecord:
    """One analyzer process's view of the record (the keys in memory; the rows in the
    database, which is the truth)."""

    def __init__(self, capacity: int = CACHED_EPOCHS) -> None:
        self._capacity = capacity
        self._epochs: OrderedDict[tuple[str, int], _Epoch] = OrderedDict()
        self._lock = threading.Lock()

    def check(
        self, conn: Connection, group: tuple[str, int], seal_keys: Sequence[bytes]
    ) -> tuple[list[int], Staged]:
        """In the fold's transaction: lock the epoch's record, the positions of ``seal_keys``
        counted before (earlier in the part or in any part folded before in the epoch), and
        the part's row of new keys written; :meth:`commit` the result after the commit."""
        generation, seq = _next_seq(conn, group)
        known = self._caught_up(conn, group, generation, seq - 1)
        repeated, fresh = _repeats(known, record_keys(seal_keys))
        conn.execute(
            insert(seen_parts).values(
                channel_id=group[0], epoch=group[1], seq=seq, keys=fresh.astype(">u8").tobytes()
            )
        )
        return repeated, Staged(group, generation, seq, _merge(known, fresh))

    def commit(self, staged: Staged) -> None:
        """Keep the epoch's keys with the committed part merged (memory follows the rows),
        unless a later fold of this process already kept more of the same record."""
        with self._lock:
            held = self._epochs.get(staged.group)
            same = held is not None and held.generation == staged.generation
            if same and held is not None and held.seq >= staged.seq:
                return
            self._keep(staged.group, _Epoch(staged.generation, staged.seq, staged.counted))

    def forget(self, group: tuple[str, int]) -> None:
        """Drop an epoch's keys from memory (retention dropped its rows)."""
        with self._lock:
            self._epochs.pop(group, None)

    def _caught_up(
        self, conn: Connection, group: tuple[str, int], generation: bytes, seq: int
    ) -> Keys:
        """The epoch's keys up to ``seq``: memory plus the rows written since it was merged
        (by other workers or folds whose commit memory missed), or all rows."""
        with self._lock:
            cached = self._epochs.get(group)
        if cached is None or cached.generation != generation or cached.seq > seq:
            cached = _Epoch(generation, 0, np.empty(0, dtype=np.uint64))
        s = seen_parts.c
        rows = conn.execute(
            select(s["keys"]).where(
                s.channel_id == group[0], s.epoch == group[1], s.seq > cached.seq, s.seq <= seq
            )
        ).scalars()
        parts = [np.frombuffer(bytes(keys), dtype=">u8").astype(np.uint64) for keys in rows]
        if not parts:
            return cached.counted
        if cached.seq == 0:
            return np.sort(np.concatenate(parts))
        counted = cached.counted
        for part in parts:
            counted = _merge(counted, part)
        return counted

    def _keep(self, group: tuple[str, int], epoch: _Epoch) -> None:
        self._epochs[group] = epoch
        self._epochs.move_to_end(group)
        while len(self._epochs) > self._capacity:
            self._epochs.popitem(last=False)


def _next_seq(conn: Connection, group: tuple[str, int]) -> tuple[bytes, int]:
    """Take the epoch's record lock and its next part number: the ``UPDATE`` row-locks the
    epoch's row until the transaction ends (PostgreSQL; SQLite's single writer already
    serializes). A first part inserts the row with a fresh generation; two first parts at once
    collide on the primary key and the fold is retried."""
    e = seen_epochs.c
    where = (e.channel_id == group[0], e.epoch == group[1])
    row = conn.execute(
        update(seen_epochs).where(*where).values(seq=e.seq + 1).returning(e.generation, e.seq)
    ).first()
    if row is not None:
        return bytes(row.generation), int(row.seq)
    generation = secrets.token_bytes(16)
    conn.execute(
        insert(seen_epochs).values(
            channel_id=group[0], epoch=group[1], generation=generation, seq=1
        )
    )
    return generation, 1


def forget_rows(conn: Connection, group: tuple[str, int]) -> int:
    """Delete an epoch's record (retention); how many keys it held."""
    s, e = seen_parts.c, seen_epochs.c
    size = select(func.coalesce(func.sum(func.length(s["keys"])), 0)).where(
        s.channel_id == group[0], s.epoch == group[1]
    )
    count = int(conn.execute(size).scalar_one()) // RECORD_KEY_SIZE
    conn.execute(delete(seen_parts).where(s.channel_id == group[0], s.epoch == group[1]))
    conn.execute(delete(seen_epochs).where(e.channel_id == group[0], e.epoch == group[1]))
    return count
