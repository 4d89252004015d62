"""The replay and quota checks of a SQLite shuffler, held in memory by its one writing process.

docs/protocol.md, "Contributions": a contribution whose nonce the shuffler holds already
is a replay, a second one of a (client, channel, epoch) is over the quota; both are 409s. On
PostgreSQL unique indexes enforce both (the replicas of a trust domain share the database). On
SQLite exactly one process writes (the launcher refuses replicas there, and :func:`writer_lock`
refuses a second writer of the file), and the two unique indexes cost two thirds of a stored
contribution's CPU: their keys are random, so each insert dirties a random page of each, which
the write-ahead log copies whole (docs/benchmarks.md, "Ingest CPU per contribution, before and
after"). So that process keeps the keys of the open epochs' rows in memory instead, loaded from
the table before the server answers anything and kept in step with every commit and close.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Key(NamedTuple):
    """What the two checks read of a contribution."""

    channel_id: str
    epoch: int
    client_id: str
    nonce: bytes


class SecondWriterError(RuntimeError):
    """Another process writes contributions to this SQLite file."""


class HeldKeys:
    """The nonces and the quotas (clients per channel and epoch) of the rows a SQLite shuffler
    holds for epochs still open. Not thread-safe: the store calls it under its writing lock.

    Memory: about 220 bytes a key (measured with tracemalloc), so ~220 MB for an open epoch of
    10^6 contributions at one shuffler.

    A nonce is refused while a row of an open epoch holds it. Keys of closed epochs are
    dropped (:meth:`forget_closed`): a contribution for a closed epoch is refused before these
    checks, whatever its keys. So, unlike PostgreSQL's unique index, a nonce held only by a
    closed epoch's rows (a held group's, or dead ones not yet swept) is taken again by a
    contribution for a later epoch. That is not a replay (a replayed ciphertext names its own,
    closed, epoch, and the analyzer's fragments are bound to it); only a client that knows the
    nonce, its own, can reuse it, and a client can send any fresh contribution anyway.
    """

    def __init__(self) -> None:
        self._nonces: set[bytes] = set()
        self._epochs: dict[tuple[str, int], tuple[set[str], list[bytes]]] = {}

    def __len__(self) -> int:
        return len(self._nonces)

    def sort(self, keys: Sequence[Key]) -> tuple[list[int], set[bytes]]:
        """Which of ``keys`` are new, in order (a key repeating an earlier one of the same
        batch is refused like one repeating a stored row), and the nonces of those refused as
        replays (the others refused are over the quota). Changes nothing: :meth:`add` the
        new ones once they are committed."""
        fresh: list[int] = []
        nonces: set[bytes] = set()
        quotas: set[tuple[str, int, str]] = set()
        replayed: set[bytes] = set()
        for index, key in enumerate(keys):
            if key.nonce in self._nonces or key.nonce in nonces:
                replayed.add(key.nonce)
            elif not self._over_quota(key) and key[:3] not in quotas:
                fresh.append(index)
                nonces.add(key.nonce)
                quotas.add(key[:3])
        return fresh, replayed

    def _over_quota(self, key: Key) -> bool:
        """Whether a row of the key's client is held for its channel and epoch."""
        held = self._epochs.get((key.channel_id, key.epoch))
        return held is not None and key.client_id in held[0]

    def add(self, keys: Iterable[Key]) -> None:
        """Hold the keys of committed rows."""
        for key in keys:
            clients, nonces = self._epochs.setdefault((key.channel_id, key.epoch), (set(), []))
            clients.add(key.client_id)
            nonces.append(key.nonce)
            self._nonces.add(key.nonce)

    def forget_closed(self, closed: dict[str, int]) -> None:
        """Drop the keys of every epoch up to the latest closed one of each channel in
        ``closed``."""
        for channel_id, epoch in [k for k in self._epochs if k[1] <= closed.get(k[0], -1)]:
            _, nonces = self._epochs.pop((channel_id, epoch))
            self._nonces.difference_update(nonces)


def lock_path(database: str) -> str:
    """The lock file of the SQLite file ``database``: beside it (symbolic links resolved, so
    two paths to one file share it), never the database itself. Closing any descriptor of
    the database file would drop the POSIX locks SQLite holds on it in this process, and
    another process could then checkpoint and delete the write-ahead log under it."""
    return os.path.realpath(database) + "-writer"


def writer_lock(database: str) -> int:
    """An exclusive lock for writing the SQLite file ``database``, held for as long as the
    returned descriptor stays open (``flock`` on :func:`lock_path`; the kernel releases it
    when the process ends).

    Raises:
        SecondWriterError: another process (or another store in this one) holds it.
    """
    descriptor = os.open(lock_path(database), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as error:
        os.close(descriptor)
        raise SecondWriterError(
            f"another shuffler process writes contributions to {database}: SQLite serves one "
            "process per file (several replicas need PostgreSQL)"
        ) from error
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor
