"""A party's keys over time, so they rotate without a restart: each HPKE or signing key is
``pending`` (loaded by every replica, not yet published), then ``active`` (the newest active one
is published, or signs), then ``retired`` (its file deleted once nothing needs it).

State lives in the party's key directory, shared by its replicas: the PEM files (``hpke.pem``
and ``signing.pem`` first, one ``<kind>-<id>.pem`` per rotation) and ``keys.json`` (each key's
times and the successions its signing keys made), changed under a file lock and replaced
whole. States follow from the times, so replicas that read the file agree without talking. A
directory without ``keys.json`` (made before rotations existed) reads as its ``hpke.pem``
(with ``hpke-previous.pem``) and ``signing.pem``, all active. Windows and the runbook:
docs/operations.md, "Key rotation".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import MAX_CLOCK_SKEW_SECONDS, fingerprint, sign_succession
from common.envelope import (
    KeyRing,
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
    write_private_key,
)
from common.wire import (
    MAX_SUCCESSIONS,
    KeyChange,
    KeyInfo,
    KeyKind,
    KeyList,
    Succession,
    b64,
)
from runtime.errors import DomainError, Kind, StorageUnavailableError

log = logging.getLogger("esa.keys")

HPKE: KeyKind = "hpke"
SIGNING: KeyKind = "signing"
#: The key directory's state and the lock its writers take.
STATE_FILE = "keys.json"
LOCK_FILE = ".keys.lock"
#: Least seconds between two failed reloads asked for by blobs naming an unknown key.
CATCH_UP_SECONDS = 1.0
#: The files of a directory made before rotations existed.
LEGACY_HPKE, LEGACY_PREVIOUS, LEGACY_SIGNING = "hpke.pem", "hpke-previous.pem", "signing.pem"


class KeyState(StrEnum):
    """Where a key is in its life (:class:`KeyRecord.state`)."""

    PENDING = "pending"
    ACTIVE = "active"
    RETIRED = "retired"


class KeyStorageError(StorageUnavailableError):
    """The key directory could not be read or written (nothing was rotated if it failed
    before ``keys.json`` was replaced)."""

    code = "key_storage_unavailable"


class RotationPendingError(DomainError):
    """A key of this kind is still pending: rotate again once it is active."""

    code = "rotation_pending"
    kind = Kind.CONFLICT


class KeyTimingError(DomainError):
    """A rotation's windows are unsafe with the channels served now (an explicit
    ``hpke_overlap_seconds`` shorter than a channel's epoch needs): raise it, then rotate."""

    code = "key_timing"
    kind = Kind.CONFLICT


class KeyInUseError(DomainError):
    """The key is the published one (or not yet active): rotate first, then retire it."""

    code = "key_in_use"
    kind = Kind.CONFLICT


class NoSuchKeyError(DomainError):
    """No key of the party has this id."""

    code = "unknown_key"
    kind = Kind.NOT_FOUND


class SuccessionLimitError(DomainError):
    """The signing key has rotated :data:`~common.wire.MAX_SUCCESSIONS` times: devices must be
    given the current key to pin (a new chain) before it rotates again."""

    code = "succession_limit"
    kind = Kind.CONFLICT


@dataclass(frozen=True)
class KeyRecord:
    """One key: its kind, id (an HPKE key id, or a signing key's fingerprint), file, public key
    (base64, kept after the file is deleted), times (unix seconds), and whether an admin retired
    it before its overlap ended (a compromised key: never held back for waiting parts)."""

    kind: KeyKind
    key_id: str
    file: str
    public_key: str
    created_at: float
    activates_at: float
    retires_at: float | None = None
    retired_early: bool = False

    def state(self, now: float) -> KeyState:
        """The key's state at ``now``."""
        if self.retires_at is not None and now >= self.retires_at:
            return KeyState.RETIRED
        return KeyState.PENDING if now < self.activates_at else KeyState.ACTIVE

    def held(self, now: float, waiting_since: float | None) -> bool:
        """Whether this retired HPKE key must stay loaded: what waits to be opened arrived
        since ``waiting_since`` (None: nothing waits), and some of it arrived before the key
        retired. A key retired early is never held."""
        return (
            self.kind == HPKE
            and self.state(now) is KeyState.RETIRED
            and not self.retired_early
            and waiting_since is not None
            and self.retires_at is not None
            and waiting_since < self.retires_at
        )


@dataclass(frozen=True)
class Timing:
    """How long a new key stays pending, and how long a replaced HPKE key keeps opening
    (a replaced signing key retires when its successor activates)."""

    activation_seconds: float
    hpke_overlap_seconds: float


def overlap_floor(ttl_seconds: float, longest_epoch_seconds: float, grace: float) -> float:
    """The shortest HPKE overlap that loses nothing acknowledged: a device seals to the replaced
    key until the last document naming it first expires (``ttl_seconds`` after the key stopped
    being published, plus clock skew), and its contribution is taken until that epoch ends
    (``longest_epoch_seconds``, plus ``grace``)."""
    return ttl_seconds + MAX_CLOCK_SKEW_SECONDS + longest_epoch_seconds + grace


def key_timing(
    reload_seconds: float,
    activation_seconds: float,
    overlap_seconds: float | None,
    floor: float,
    allowance: float,
) -> Timing:
    """The windows of a party's rotations: ``overlap_seconds`` (None: ``floor`` plus
    ``allowance``), never less than ``floor`` (:func:`overlap_floor`: channels added since the
    settings were checked may have longer epochs).

    Raises:
        ValueError: a key would be published before every replica reloads it (activation
            shorter than twice the reload interval), or an overlap below ``floor``.
    """
    if activation_seconds < 2 * reload_seconds:
        raise ValueError(
            f"key_activation_seconds={activation_seconds:g} must be at least twice the key "
            f"reload interval ({reload_seconds:g} s): every replica loads a new key before "
            "devices are told to use it"
        )
    if overlap_seconds is not None and overlap_seconds < floor:
        raise ValueError(
            f"hpke_overlap_seconds={overlap_seconds:g} is shorter than {floor:.0f} s (document "
            "ttl + clock skew + longest epoch + grace): what devices sealed to a replaced key "
            "before their document expired would be lost"
        )
    overlap = floor + allowance if overlap_seconds is None else overlap_seconds
    return Timing(activation_seconds, overlap)


@dataclass(frozen=True)
class KeyBook:
    """What ``keys.json`` holds: every key, oldest first, and the signing keys' successions."""

    records: tuple[KeyRecord, ...]
    successions: tuple[Succession, ...] = ()

    def newest_active(self, kind: KeyKind, now: float) -> KeyRecord | None:
        """The published key of ``kind`` at ``now`` (latest activation; the later record on a
        tie)."""
        active = [
            (r.activates_at, i, r)
            for i, r in enumerate(self.records)
            if r.kind == kind and r.state(now) is KeyState.ACTIVE
        ]
        return max(active, key=lambda found: found[:2])[2] if active else None

    def to_json(self) -> str:
        """The file's text."""
        return json.dumps(
            {
                "version": 1,
                "keys": [asdict(r) for r in self.records],
                "successions": [s.model_dump() for s in self.successions],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> KeyBook:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: not such a file.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a version 1 key state file")
        records = tuple(_checked(KeyRecord(**r)) for r in data["keys"])
        return cls(records, tuple(Succession.model_validate(s) for s in data["successions"]))

    def check_usable(self, now: float) -> None:
        """A book a party can run on at ``now``: an active signing key and an active HPKE key.

        Raises:
            ValueError: one is missing (the file was edited or damaged: the keys in use stay,
                and no key file is deleted on its word).
        """
        for kind in (SIGNING, HPKE):
            if self.newest_active(kind, now) is None:
                raise ValueError(f"{STATE_FILE} names no active {kind} key")


@dataclass(frozen=True)
class PartyKeys:
    """A party's keys at one moment: the book, its states at ``at``, and the private keys of
    those not retired (and of retired ones held back by :meth:`KeyDirectory.load`)."""

    book: KeyBook
    at: float
    hpke: dict[str, X25519PrivateKey]
    signing: dict[str, Ed25519PrivateKey]

    @property
    def successions(self) -> tuple[Succession, ...]:
        """The successions documents carry: from the first key to :attr:`signer` (not to a
        key still pending)."""
        signer = b64(public_bytes(self.signer.public_key()))
        chain = self.book.successions
        ends = [i for i, link in enumerate(chain) if link.to_key == signer]
        return chain[: ends[0] + 1] if ends else ()

    @property
    def signer(self) -> Ed25519PrivateKey:
        """The key that signs now (the newest active signing key)."""
        record = self.book.newest_active(SIGNING, self.at)
        if record is None:
            raise ValueError("no active signing key")
        return self.signing[record.key_id]

    def published_hpke(self) -> tuple[X25519PrivateKey, ...]:
        """The active HPKE keys, newest (the one devices seal to) first."""
        active = [
            (r.activates_at, i, self.hpke[r.key_id])
            for i, r in enumerate(self.book.records)
            if r.kind == HPKE and r.state(self.at) is KeyState.ACTIVE and r.key_id in self.hpke
        ]
        return tuple(key for *_, key in sorted(active, key=lambda k: k[:2], reverse=True))

    def ring(self) -> KeyRing:
        """Every loaded HPKE key (pending ones open already), the newest active current,
        retired ones named so a blob sealed to one is told apart from garbage."""
        published = self.published_hpke()
        keys = {bytes.fromhex(kid): key for kid, key in self.hpke.items()}
        retired = frozenset(
            bytes.fromhex(r.key_id)
            for r in self.book.records
            if r.kind == HPKE and r.key_id not in self.hpke
        )
        current = key_id(published[0].public_key()) if published else b""
        return KeyRing(keys, current, retired)

    def fingerprint(self) -> tuple[object, ...]:
        """What a change of makes a service republish or swap keys: the states and the chain."""
        states = tuple((r.kind, r.key_id, r.state(self.at)) for r in self.book.records)
        return states, len(self.book.successions), tuple(sorted(self.hpke))

    def listing(self, party: str) -> KeyList:
        """``GET /v1/admin/keys``."""
        return KeyList(
            party=party,
            keys=[self.info(record) for record in self.book.records],
            successions=list(self.book.successions),
        )

    def info(self, record: KeyRecord) -> KeyInfo:
        """One key as ``GET /v1/admin/keys`` shows it."""
        published = self.book.newest_active(record.kind, self.at)
        return KeyInfo(
            kind=record.kind,
            key_id=record.key_id,
            public_key=record.public_key,
            state=record.state(self.at),
            published=published is not None and published.key_id == record.key_id,
            created_at=record.created_at,
            activates_at=record.activates_at,
            retires_at=record.retires_at,
        )


def _identify(key: X25519PrivateKey | Ed25519PrivateKey) -> tuple[str, str]:
    """A key's id (HPKE key id, or signing key fingerprint) and public key, base64."""
    if isinstance(key, X25519PrivateKey):
        return key_id(key.public_key()).hex(), b64(public_bytes(key.public_key()))
    return fingerprint(key.public_key()), b64(public_bytes(key.public_key()))


def _record(directory: Path, file: str, key: X25519PrivateKey | Ed25519PrivateKey) -> KeyRecord:
    """A key active from the start (one a directory made before rotations began with)."""
    kid, public = _identify(key)
    kind: KeyKind = HPKE if isinstance(key, X25519PrivateKey) else SIGNING
    return KeyRecord(
        kind=kind,
        key_id=kid,
        file=file,
        public_key=public,
        created_at=(directory / file).stat().st_mtime,
        activates_at=0.0,
    )


def _checked(record: KeyRecord) -> KeyRecord:
    """``record`` if each field has its type (a file edited by hand or damaged).

    Raises:
        ValueError: naming the field.
    """
    texts = ("kind", "key_id", "file", "public_key")
    times = ("created_at", "activates_at")
    for name in texts:
        if not isinstance(getattr(record, name), str):
            raise ValueError(f"key {name} must be text")
    for name in times:
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"key {name} must be a number of seconds")
    retires = record.retires_at
    if retires is not None and (isinstance(retires, bool) or not isinstance(retires, int | float)):
        raise ValueError("key retires_at must be a number of seconds or null")
    if not isinstance(record.retired_early, bool):
        raise ValueError("key retired_early must be true or false")
    if record.kind not in (HPKE, SIGNING) or "/" in record.file or record.file.startswith("."):
        raise ValueError(f"key kinds must be {HPKE} or {SIGNING}, files plain names")
    return record


class KeyDirectory:
    """A party's key directory: read by every replica, changed under a lock by the one that
    rotates."""

    def __init__(self, path: Path, party: str) -> None:
        self.path = path
        self.party = party

    def book(self) -> KeyBook:
        """The keys as ``keys.json`` states them, or as a directory made before rotations
        holds them (creating ``hpke.pem`` and ``signing.pem`` on first use).

        Raises:
            ValueError: ``keys.json`` is not a key state file.
        """
        state = self.path / STATE_FILE
        if state.exists():
            try:
                return KeyBook.from_json(state.read_text())
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{state}: {error}") from error
        rotated = sorted(p.name for p in self.path.glob("*-*.pem") if p.name != LEGACY_PREVIOUS)
        if rotated:  # never fall back to the first keys once they rotated
            raise ValueError(
                f"{state} is missing, yet keys made by rotations are here ({', '.join(rotated)}): "
                "restore it from a backup of the key directory"
            )
        records = []
        if (self.path / LEGACY_PREVIOUS).exists():
            previous = load_or_create_x25519(self.path / LEGACY_PREVIOUS)
            records.append(_record(self.path, LEGACY_PREVIOUS, previous))
        hpke = load_or_create_x25519(self.path / LEGACY_HPKE)
        records.append(_record(self.path, LEGACY_HPKE, hpke))
        signing = load_or_create_ed25519(self.path / LEGACY_SIGNING)
        records.append(_record(self.path, LEGACY_SIGNING, signing))
        return KeyBook(tuple(records))

    def load(self, now: float, waiting_since: float | None = None) -> PartyKeys:
        """The keys at ``now``, with the private keys of those not retired and of retired HPKE
        keys still held for what waits since ``waiting_since`` (:meth:`KeyRecord.held`) whose
        file is still there.

        Raises:
            ValueError: a live key's file is missing or holds another key than ``keys.json``
                names (naming the file), or the book names no active key of a kind.
        """
        book = self.book()
        book.check_usable(now)
        hpke: dict[str, X25519PrivateKey] = {}
        signing: dict[str, Ed25519PrivateKey] = {}
        for record in book.records:
            live = record.state(now) is not KeyState.RETIRED
            if not live and not record.held(now, waiting_since):
                continue
            key = self._private(record, required=live)
            if isinstance(key, X25519PrivateKey):
                hpke[record.key_id] = key
            elif isinstance(key, Ed25519PrivateKey):
                signing[record.key_id] = key
        return PartyKeys(book, now, hpke, signing)

    def _private(
        self, record: KeyRecord, required: bool
    ) -> X25519PrivateKey | Ed25519PrivateKey | None:
        """The private key of ``record``; None for one not ``required`` (retired) whose file
        is gone or holds another key (e.g. ``hpke.pem`` made again by an older launcher)."""
        path = self.path / record.file
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError as error:
            if required:
                raise ValueError(
                    f"{path}: the {record.kind} key {record.key_id} is missing"
                ) from error
            return None
        if not isinstance(key, X25519PrivateKey | Ed25519PrivateKey) or _identify(key) != (
            record.key_id,
            record.public_key,
        ):
            if required:
                raise ValueError(f"{path} does not hold the {record.kind} key {record.key_id}")
            log.warning(
                "a retired key's file holds another key; the key is treated as gone",
                extra={"file": str(path), "key_id": record.key_id},
            )
            return None
        return key

    @contextlib.contextmanager
    def _locked(self) -> Iterator[KeyBook]:
        """The book, read under the directory's lock (held until the block ends)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self.book()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, book: KeyBook) -> None:
        """Replace ``keys.json`` whole (a reader sees the old file or the new one)."""
        descriptor, temporary = tempfile.mkstemp(prefix=f".{STATE_FILE}.", dir=self.path)
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(book.to_json() + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path / STATE_FILE)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def rotate(self, kind: KeyKind, now: float, timing: Timing) -> KeyRecord:
        """Make a new key of ``kind``, pending for ``timing.activation_seconds``; the keys of
        that kind active now retire once it is active (HPKE: after ``hpke_overlap_seconds``
        more). A new signing key is named by the current one in a succession.

        Raises:
            RotationPendingError: a key of ``kind`` is pending already.
            SuccessionLimitError: the signing key rotated too often to rotate again.
        """
        with self._locked() as book:
            pending = [
                r for r in book.records if r.kind == kind and r.state(now) is KeyState.PENDING
            ]
            if pending:
                raise RotationPendingError(
                    f"the {kind} key {pending[0].key_id} is pending until "
                    f"{pending[0].activates_at:.0f}: rotate again once it is active"
                )
            if kind == SIGNING and len(book.successions) >= MAX_SUCCESSIONS:
                raise SuccessionLimitError(
                    f"the signing key rotated {MAX_SUCCESSIONS} times: give devices the current "
                    "key to pin, then start a new key directory"
                )
            new_key = X25519PrivateKey.generate() if kind == HPKE else Ed25519PrivateKey.generate()
            kid, public = _identify(new_key)
            write_private_key(self.path / f"{kind}-{kid}.pem", new_key)
            record = KeyRecord(
                kind=kind,
                key_id=kid,
                file=f"{kind}-{kid}.pem",
                public_key=public,
                created_at=now,
                activates_at=now + timing.activation_seconds,
            )
            overlap = timing.hpke_overlap_seconds if kind == HPKE else 0.0
            book = _replaced(book, record, record.activates_at + overlap, now)
            if isinstance(new_key, Ed25519PrivateKey):
                book = replace(
                    book, successions=(*book.successions, self._succession(book, now, new_key))
                )
            self._write(book)
        log.info(
            "key rotated", extra={"kind": kind, "key_id": kid, "activates_at": record.activates_at}
        )
        return record

    def _succession(self, book: KeyBook, now: float, new: Ed25519PrivateKey) -> Succession:
        """The current signer naming ``new`` as its successor."""
        current = book.newest_active(SIGNING, now)
        if current is None:
            raise ValueError(f"{self.path}: no active signing key to hand over from")
        old = self._private(current, required=True)
        assert isinstance(old, Ed25519PrivateKey)
        return sign_succession(self.party, old, new.public_key(), int(now))

    def retire(self, kid: str, now: float) -> KeyRecord:
        """Retire an HPKE key now (before its overlap ends); retiring a retired key changes
        nothing.

        Raises:
            NoSuchKeyError: no HPKE key has id ``kid``.
            KeyInUseError: it is the published key, or still pending.
        """
        with self._locked() as book:
            found = [r for r in book.records if r.kind == HPKE and r.key_id == kid]
            if not found:
                raise NoSuchKeyError(f"no HPKE key {kid[:16]!r} (esa keys list names them)")
            record = found[0]
            state = record.state(now)
            if state is KeyState.RETIRED:
                return record
            published = book.newest_active(HPKE, now)
            if state is KeyState.PENDING or (published is not None and published.key_id == kid):
                what = "pending" if state is KeyState.PENDING else "the published one"
                raise KeyInUseError(
                    f"the HPKE key {kid} is {what}: rotate, wait until the new key is active, "
                    "then retire this one"
                )
            retired = replace(record, retires_at=now, retired_early=True)
            self._write(
                replace(book, records=tuple(retired if r is record else r for r in book.records))
            )
        log.warning("HPKE key retired before its overlap ended", extra={"key_id": kid})
        return retired

    def prune(self, now: float, waiting_since: float | None = None) -> list[str]:
        """Delete the files of retired keys: HPKE keys not held for what waits since
        ``waiting_since`` (:meth:`KeyRecord.held`: what was sealed to them can no longer be
        opened by anyone who takes the directory later), and signing keys that handed over in
        a succession, once every replica's clock is past their retirement (whoever takes the
        directory later cannot fork the chain from them); the ids deleted."""
        book = self.book()
        book.check_usable(now)
        handed_over = {link.from_key for link in book.successions}
        doomed = [
            r
            for r in book.records
            if r.state(now) is KeyState.RETIRED
            and (self.path / r.file).exists()
            and (
                not r.held(now, waiting_since)
                if r.kind == HPKE
                else r.public_key in handed_over
                and now >= (r.retires_at or now) + MAX_CLOCK_SKEW_SECONDS
            )
        ]
        for record in doomed:
            (self.path / record.file).unlink(missing_ok=True)
            log.info("retired key deleted", extra={"kind": record.kind, "key_id": record.key_id})
        return [r.key_id for r in doomed]


def _replaced(book: KeyBook, new: KeyRecord, retires_at: float, now: float) -> KeyBook:
    """``book`` with ``new`` added and the keys of its kind active at ``now`` retiring at
    ``retires_at`` at the latest."""
    records = [
        replace(r, retires_at=min(r.retires_at or math.inf, retires_at))
        if r.kind == new.kind and r.state(now) is KeyState.ACTIVE
        else r
        for r in book.records
    ]
    return replace(book, records=(*records, new))


class LiveKeys:
    """A party's keys as one process uses them: :attr:`current` (states at the instant it is
    read, so every replica switches at the same time) and :attr:`ring` (one object its holders
    share, refilled in place), read again from the key directory every ``reload_seconds``
    (:meth:`refresh`, or a thread: :meth:`start`), so a rotation made at one replica reaches
    them all before its key is published. ``listeners`` hear of the newest keys, in order,
    after a reload that changed a key's state. ``waiting_since`` says since when what waits to
    be opened arrived (the analyzer: its oldest stored part not opened yet; None: nothing
    waits): a retired HPKE key stays loaded while some of it arrived before the key retired,
    unless an admin retired it early (:meth:`KeyRecord.held`); when it fails, they stay."""

    def __init__(
        self,
        directory: KeyDirectory,
        timing: Callable[[], Timing],
        clock: Callable[[], float] = time.time,
        waiting_since: Callable[[], float | None] = lambda: None,
        reload_seconds: float = 10.0,
    ) -> None:
        self.directory = directory
        self.timing = timing
        self.clock = clock
        self.waiting_since = waiting_since
        self.reload_seconds = reload_seconds
        # Retired HPKE keys still on disk stay loaded until the first reload asks (the
        # database may not be ready yet), except those retired early.
        self._stamp = self._state_stamp()
        self._loaded = directory.load(clock(), waiting_since=-math.inf)
        self._seen = self._loaded.fingerprint()
        self.ring = self._loaded.ring()
        self.listeners: list[Callable[[PartyKeys], None]] = []
        self._loaded_at = time.monotonic()
        #: Least seconds between two reloads :meth:`catch_up` tries after one failed.
        self.catch_up_seconds = CATCH_UP_SECONDS
        self._failed_at = -math.inf
        self._lock = threading.Lock()
        self._catching = threading.Lock()
        self._telling = threading.Lock()  # listeners hear of one change at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _waiting_since(self) -> float | None:
        try:
            return self.waiting_since()
        except Exception:  # the database, mostly: keep what may still be needed
            log.exception("cannot tell whether retired keys are still needed; kept")
            return -math.inf

    @property
    def current(self) -> PartyKeys:
        """The keys last loaded, their states at this instant (pending keys are loaded ahead,
        so a replica that has not reloaded since a key activated signs with it all the same)."""
        return replace(self._loaded, at=self.clock())

    def reload(self) -> PartyKeys:
        """Read the key directory now (deleting the files of retired keys not needed), then
        tell the listeners if a key's state changed since the last reload.

        Raises:
            ValueError: the directory is unusable (the keys in use stay).
        """
        with self._lock:
            now, since = self.clock(), self._waiting_since()
            self.directory.prune(now, since)
            stamp = self._state_stamp()
            fresh = self.directory.load(now, since)
            self._stamp = stamp
            seen, self._seen = self._seen, fresh.fingerprint()
            changed = seen != self._seen
            self._loaded = fresh
            self.ring.replace(fresh.ring())
            self._loaded_at = time.monotonic()
        if changed:
            log.info("keys changed", extra={"party": self.directory.party})
            with self._telling:  # the newest keys, read here: a slower reload never wins
                newest = self.current
                for listener in self.listeners:
                    listener(newest)
        return fresh

    def refresh(self) -> None:
        """:meth:`reload` if the last one is ``reload_seconds`` old; a failure is logged and
        the keys in use stay."""
        if time.monotonic() - self._loaded_at < self.reload_seconds:
            return
        try:
            self.reload()
        except Exception:
            log.exception("reading the key directory failed; the keys in use stay")

    def _state_stamp(self) -> tuple[int, int, int] | None:
        """What tells ``keys.json`` apart from the one last loaded (replaced whole: a new
        inode); None without one."""
        try:
            found = os.stat(self.directory.path / STATE_FILE)
        except FileNotFoundError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size

    def stale(self) -> bool:
        """Whether ``keys.json`` changed since it was last loaded (one ``stat``: cheap enough
        for every blob naming a key this replica lacks, which anyone can send)."""
        try:
            return self._state_stamp() != self._stamp
        except OSError:  # unreadable: a reload will say why
            return True

    def catch_up(self) -> bool:
        """A blob named a key this replica lacks: :meth:`reload` if ``keys.json`` changed
        since it was last loaded (another replica may have just made the key); whether the
        keys loaded are the file's now (False: the reload failed, or one failed less than
        :attr:`catch_up_seconds` ago). It blocks on the key files: call it off an event loop."""
        with self._catching:
            if not self.stale():
                return True
            if time.monotonic() - self._failed_at < self.catch_up_seconds:
                return False
            try:
                self.reload()
            except Exception:
                self._failed_at = time.monotonic()
                log.exception("reading the key directory failed; the keys in use stay")
                return False
        return True

    def start(self) -> None:
        """Reload every ``reload_seconds`` in a background thread."""
        self._thread = threading.Thread(target=self._run, name="esa-keys", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.reload_seconds):
            self._loaded_at = -math.inf
            self.refresh()

    def stop(self) -> None:
        """Stop the background reloads."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.reload_seconds + 5)

    def listing(self) -> KeyList:
        """``GET /v1/admin/keys``: every key as ``keys.json`` states it now (a read: nothing
        is loaded, deleted or told).

        Raises:
            KeyStorageError: the key directory is unreadable.
        """
        with _storage():
            book = self.directory.book()
        return PartyKeys(book, self.clock(), {}, {}).listing(self.directory.party)

    def rotate(self, kind: KeyKind) -> KeyChange:
        """``POST /v1/admin/keys/rotate`` (:meth:`KeyDirectory.rotate`), then reload.

        Raises:
            RotationPendingError, SuccessionLimitError: as :meth:`KeyDirectory.rotate`.
            KeyTimingError: the windows are unsafe with the channels served now.
            KeyStorageError: the key directory is unreadable or unwritable.
        """
        timing = checked_timing(self.timing)
        with _storage():
            record = self.directory.rotate(kind, self.clock(), timing)
            keys = self.reload()
        return KeyChange(key=keys.info(record), keys=keys.listing(self.directory.party))

    def retire(self, kid: str) -> KeyChange:
        """``POST /v1/admin/keys/retire`` (:meth:`KeyDirectory.retire`), then reload.

        Raises:
            NoSuchKeyError, KeyInUseError: as :meth:`KeyDirectory.retire`.
            KeyStorageError: the key directory is unreadable or unwritable.
        """
        with _storage():
            record = self.directory.retire(kid, self.clock())
            keys = self.reload()
        return KeyChange(key=keys.info(record), keys=keys.listing(self.directory.party))


def checked_timing(timing: Callable[[], Timing]) -> Timing:
    """``timing()``, its refusal (:func:`key_timing`) as :class:`KeyTimingError`: a party
    checks a channel it is about to serve with it too.

    Raises:
        KeyTimingError: the windows are unsafe.
    """
    try:
        return timing()
    except ValueError as error:
        raise KeyTimingError(str(error)) from error


@contextlib.contextmanager
def _storage() -> Iterator[None]:
    """Failures of the key directory as :class:`KeyStorageError` (an admin gets 503, naming
    the file, never a 500)."""
    try:
        yield
    except (OSError, TypeError, ValueError) as error:
        raise KeyStorageError(f"key directory: {error}") from error
