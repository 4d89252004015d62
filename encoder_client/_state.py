"""Device state in one small SQLite file (stdlib ``sqlite3``; no server dependencies).

Holds the enrolment tokens, the issue time of the newest collection config and shuffler
descriptors accepted (an older one is a replay, refused), the key each party's pin moved to
through its successions (a fork from an older key is refused), report-fragment backstops,
longitudinal tree states, each channel's pinned privacy terms (never relaxed while the file
lives: :mod:`common.terms`), which (channel, epoch) pairs were already reported with the local
ε each report spent (the device budget, never reset while the file lives), and the outbox of
sealed, unsent contributions.
A state file that fails SQLite's integrity check, or holds channel state without an identity,
is moved aside and replaced by a fresh one: the device becomes a new device (new id, new
backstops), never a silent mix of old and new randomness.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.terms import ChannelTerms
from encoder_client._errors import BudgetExceededError, StateError, StateFileError

log = logging.getLogger("esa.client")
#: Relative slack when comparing spend with a budget, so that a budget of exactly k reports'
#: ε admits k reports despite floating-point sums.
BUDGET_SLACK = 1e-9

SCHEMA = """
CREATE TABLE IF NOT EXISTS identity (device_id TEXT PRIMARY KEY, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (shuffler_id TEXT PRIMARY KEY, token TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS seen (name TEXT PRIMARY KEY, issued_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pins (party TEXT PRIMARY KEY, root TEXT NOT NULL, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS terms (channel_id TEXT PRIMARY KEY, terms TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS channel_state (channel_id TEXT PRIMARY KEY, kind TEXT NOT NULL,
                                          data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reported (channel_id TEXT NOT NULL, epoch INTEGER NOT NULL,
                                     PRIMARY KEY (channel_id, epoch));
CREATE TABLE IF NOT EXISTS spend (channel_id TEXT NOT NULL, epoch INTEGER NOT NULL,
                                  epoch_start REAL NOT NULL, eps REAL NOT NULL,
                                  PRIMARY KEY (channel_id, epoch));
CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, shuffler_id TEXT NOT NULL,
                                   body BLOB NOT NULL, created_at REAL NOT NULL,
                                   attempts INTEGER NOT NULL DEFAULT 0,
                                   next_attempt_at REAL NOT NULL DEFAULT 0);
"""


@dataclass(frozen=True)
class Limit:
    """One cap on local-ε spend: over ``channel_id`` (None: every channel) and over reports
    whose epoch started at or after ``since`` (None: the device's lifetime); ``by_app``: the
    app's own cap rather than the signed config's."""

    eps: float
    channel_id: str | None = None
    since: float | None = None
    by_app: bool = False

    def describe(self) -> str:
        """Which budget this is, in words."""
        scope = "all channels" if self.channel_id is None else f"channel {self.channel_id!r}"
        span = "lifetime" if self.since is None else "rolling window"
        whose = "the app's" if self.by_app else "the"
        return f"{whose} {span} budget ε={self.eps:g} of {scope}"


@dataclass(frozen=True)
class Charge:
    """What one report costs: its local ε, the start of its epoch, and the caps it must fit."""

    eps: float
    epoch_start: float
    limits: tuple[Limit, ...] = ()


@dataclass(frozen=True)
class OutboxItem:
    """A sealed contribution waiting for its shuffler's 202."""

    id: int
    shuffler_id: str
    body: bytes
    attempts: int


def _check_writable(path: Path) -> None:
    """The state file can be created and written: a regular file (or none yet) in a folder
    we can write (SQLite also writes ``-wal`` and ``-shm`` files next to it).

    Raises:
        StateFileError: naming the path and the reason.
    """
    try:
        if path.parent.exists() and not path.parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{path.parent.name} is not a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a regular file")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "its folder is not writable")
    except OSError as error:
        reason = error.strerror or str(error)
        raise StateFileError(f"device state file {path} cannot be used: {reason}") from error


class DeviceState:
    """The SDK's persistent state; one instance per state file, safe across threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.was_reset = False
        self._lock = threading.RLock()
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        """Open (or create) the file; reset it only when its content is not a usable database.

        Raises:
            StateFileError: the path cannot be opened, created or written (a directory, a
                read-only file or folder, a lock held by another process): nothing is moved.
        """
        _check_writable(self.path)
        try:
            return self._initialise(self._connect())
        except sqlite3.OperationalError as error:  # cannot open, read-only, locked: not corrupt
            raise StateFileError(f"device state file {self.path}: {error}") from error
        except sqlite3.DatabaseError as error:  # not a database, malformed, failed the check
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.warning(
                "device state unusable; starting as a new device",
                extra={"moved_to": str(aside), "reason": str(error)},
            )
            try:
                self.path.replace(aside)
                self.was_reset = True
                return self._initialise(self._connect())
            except (OSError, sqlite3.Error) as again:
                raise StateFileError(f"device state file {self.path}: {again}") from again

    def _initialise(self, db: sqlite3.Connection) -> sqlite3.Connection:
        """Check integrity, create the tables and the identity of a new device (``db`` is
        closed if any of it fails)."""
        try:
            self._create(db)
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        if db.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("integrity check failed")
        db.executescript(SCHEMA)
        if db.execute("SELECT count(*) FROM identity").fetchone()[0] == 0:
            if db.execute("SELECT count(*) FROM channel_state").fetchone()[0]:
                raise sqlite3.DatabaseError("channel state without a device identity")
            db.execute("INSERT INTO identity VALUES (?, ?)", (secrets.token_hex(16), time.time()))

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
        except BaseException:
            db.close()
            raise
        return db

    @property
    def device_id(self) -> str:
        """This device's identity (changes only when the state is lost or reset)."""
        with self._lock:
            return str(self._db.execute("SELECT device_id FROM identity").fetchone()[0])

    def token(self, shuffler_id: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT token FROM tokens WHERE shuffler_id = ?", (shuffler_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def set_token(self, shuffler_id: str, token: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO tokens VALUES (?, ?)", (shuffler_id, token))

    def seen(self) -> dict[str, int]:
        """Issue time of the newest signed document accepted, by name (the config, each
        shuffler's descriptor: :attr:`common.collection.VerifiedConfig.versions`)."""
        with self._lock:
            rows = self._db.execute("SELECT name, issued_at FROM seen").fetchall()
        return {str(name): int(issued) for name, issued in rows}

    def see(self, versions: Mapping[str, int]) -> None:
        """Remember ``versions`` as accepted (an issue time never moves back)."""
        with self._lock:
            self._db.executemany(
                "INSERT INTO seen VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                "issued_at = max(issued_at, excluded.issued_at)",
                list(versions.items()),
            )

    def pins(self, roots: Mapping[str, str]) -> dict[str, str]:
        """The keys (base64) this device moved each party's pin to, for the root keys it pins
        now (``roots``: a pin moved from another root, before the app was given new keys, no
        longer counts)."""
        with self._lock:
            rows = self._db.execute("SELECT party, root, key FROM pins").fetchall()
        return {str(party): str(key) for party, root, key in rows if roots.get(party) == root}

    def move_pins(self, roots: Mapping[str, str], pins: Mapping[str, str]) -> None:
        """Remember the key each party's pin moved to from its root (where a config's signers
        descend from the pinned keys through successions)."""
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO pins VALUES (?, ?, ?)",
                [(party, roots[party], key) for party, key in pins.items() if party in roots],
            )

    def pinned_terms(self) -> dict[str, ChannelTerms]:
        """The privacy terms pinned for each channel this device accepted.

        Raises:
            StateError: a pinned entry does not parse (the file was edited or damaged).
        """
        with self._lock:
            rows = self._db.execute("SELECT channel_id, terms FROM terms").fetchall()
        try:
            return {str(c): ChannelTerms.model_validate_json(t) for c, t in rows}
        except ValueError as error:
            raise StateError(f"device state file {self.path}: unusable pinned terms") from error

    def pin_terms(self, terms: Mapping[str, ChannelTerms]) -> None:
        """Pin ``terms`` by channel (first accepted, or strictly stronger than the pinned)."""
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO terms VALUES (?, ?)",
                [(channel, t.model_dump_json()) for channel, t in terms.items()],
            )

    def channel_state(self, channel_id: str, kind: str) -> dict[str, Any] | None:
        """Saved device state of a channel, if any.

        Raises:
            StateError: if the saved state belongs to another kind of channel.
        """
        with self._lock:
            row = self._db.execute(
                "SELECT kind, data FROM channel_state WHERE channel_id = ?", (channel_id,)
            ).fetchone()
        if row is None:
            return None
        if row[0] != kind:
            raise StateError(f"state of channel {channel_id!r} is {row[0]}, not {kind}")
        return dict(json.loads(row[1]))

    def commit_report(
        self,
        channel_id: str,
        epoch: int,
        kind: str,
        data: dict[str, Any] | None,
        outbox: list[tuple[str, bytes]],
        charge: Charge | None = None,
    ) -> bool:
        """Atomically mark (channel, epoch) reported, charge its local ε, save channel state and
        queue contributions.

        Returns False, changing nothing, if (channel, epoch) was already reported.

        Raises:
            BudgetExceededError: the charge does not fit a limit (nothing is changed).
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO reported VALUES (?, ?)", (channel_id, epoch))
            except sqlite3.IntegrityError:
                self._db.execute("ROLLBACK")
                return False
            try:
                if charge is not None:
                    self._charge(channel_id, epoch, charge)
                if data is not None:
                    self._db.execute(
                        "INSERT OR REPLACE INTO channel_state VALUES (?, ?, ?)",
                        (channel_id, kind, json.dumps(data)),
                    )
                now = time.time()
                self._db.executemany(
                    "INSERT INTO outbox (shuffler_id, body, created_at) VALUES (?, ?, ?)",
                    [(s, b, now) for s, b in outbox],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return True

    def _charge(self, channel_id: str, epoch: int, charge: Charge) -> None:
        for limit in charge.limits:
            spent = self.spent(limit.channel_id, limit.since)
            if spent + charge.eps > limit.eps * (1.0 + BUDGET_SLACK):
                raise BudgetExceededError(
                    f"a report on channel {channel_id!r} costs local ε={charge.eps:g}; "
                    f"{limit.describe()} has {max(0.0, limit.eps - spent):g} left"
                )
        self._db.execute(
            "INSERT INTO spend VALUES (?, ?, ?, ?)",
            (channel_id, epoch, charge.epoch_start, charge.eps),
        )

    def spent(self, channel_id: str | None = None, since: float | None = None) -> float:
        """Local ε spent so far on ``channel_id`` (None: all channels) by reports whose epoch
        started at or after ``since`` (None: ever)."""
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(eps), 0) FROM spend WHERE (? IS NULL OR channel_id = ?) "
                "AND (? IS NULL OR epoch_start >= ?)",
                (channel_id, channel_id, since, since),
            ).fetchone()
        return float(row[0])

    def save_state(self, channel_id: str, kind: str, data: dict[str, Any]) -> None:
        """Persist a channel's device state outside a report (a longitudinal update)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO channel_state VALUES (?, ?, ?)",
                (channel_id, kind, json.dumps(data)),
            )

    def due(self, now: float, limit: int = 256) -> list[OutboxItem]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, shuffler_id, body, attempts FROM outbox WHERE next_attempt_at <= ? "
                "ORDER BY id LIMIT ?",
                (now, limit),
            ).fetchall()
        return [OutboxItem(int(r[0]), str(r[1]), bytes(r[2]), int(r[3])) for r in rows]

    def delivered(self, item_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM outbox WHERE id = ?", (item_id,))

    def retry_later(self, item_id: int, at: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE outbox SET attempts = attempts + 1, next_attempt_at = ? WHERE id = ?",
                (at, item_id),
            )

    def outbox_size(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
