"""The shufflers' own signed descriptors, which the collection config passes on to devices.

The analyzer never states a shuffler's URL or HPKE key itself (docs/protocol.md, "Who vouches
for what"): it keeps each registered shuffler's ``GET /v1/descriptor`` only if it verifies with the
key pinned for that shuffler or one its successions lead to, keeps the newest in the database,
and verifies that shuffler's batches with the key that signed it. Details:
docs/architecture.md, "Shuffler descriptors".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from analyzer.errors import ShufflersUnavailableError
from analyzer.store import AnalyzerStore
from common.collection import (
    MAX_CLOCK_SKEW_SECONDS,
    CollectionConfigError,
    Vouched,
    descriptor_id,
    fingerprint,
    parse_key,
    verify_descriptor_chain,
)
from common.envelope import public_bytes
from common.fetching import (
    FETCH_DEADLINE_SECONDS,
    FetchTooLargeError,
    deadline_client,
    fetch_within,
)
from common.wire import ShufflerDescriptor, ShufflerEntry, SignedDescriptor

log = logging.getLogger("esa.analyzer")

#: Largest descriptor read: its keys and at most 32 successions take a few kilobytes.
MAX_DESCRIPTOR_BYTES = 256 * 1024
#: Seconds between fetches while a descriptor is still missing.
RETRY_SECONDS = 1.0
#: Least seconds between two looks for a shuffler's newer signing key after bad signatures
#: (anyone can send a part that names a registered shuffler and fails to verify).
RENEW_SECONDS = 1.0


class ShufflerDescriptors:
    """The newest verified descriptor of each registered shuffler, kept in ``store``."""

    def __init__(
        self,
        entries: Sequence[ShufflerEntry],
        store: AnalyzerStore,
        clock: Callable[[], float] = time.time,
        renew_seconds: float = RENEW_SECONDS,
        deadline_seconds: float = FETCH_DEADLINE_SECONDS,
    ) -> None:
        self.entries = list(entries)
        #: Whole-request deadline of one descriptor fetch.
        self.deadline_seconds = deadline_seconds
        self.renew_seconds = renew_seconds
        self.store = store
        self.clock = clock
        self._keys = {e.id: parse_key(e.signing_key, f"shuffler {e.id!r}") for e in entries}
        #: Each shuffler's current signing key: the signer of its newest verified descriptor
        #: (the pinned key until one is seen); batches must verify with it.
        self.signers: dict[str, Ed25519PublicKey] = dict(self._keys)
        self._renewed: dict[str, float] = {}
        self._stop = threading.Event()
        self._wakes = {e.id: threading.Event() for e in entries}
        self._threads: list[threading.Thread] = []
        #: Readers and writers of :attr:`signers` (each shuffler's fetch runs in a thread).
        self._lock = threading.RLock()

    def offer(self, document: SignedDescriptor) -> bool:
        """Keep ``document`` if it verifies with the pinned key of the shuffler it names and
        is newer than the one kept; True if it was kept.

        Raises:
            CollectionConfigError: it names an unregistered shuffler or does not verify.
        """
        named = descriptor_id(document)
        key = self._keys.get(named)
        if key is None:
            raise CollectionConfigError(f"descriptor of unregistered shuffler {named[:64]!r}")
        vouched = verify_descriptor_chain(document, key, self.clock())
        with self._lock:
            kept = self.store.descriptors()
            self._check_descends(named, vouched, kept)
            descriptor = vouched.value
            stale = named not in self._valid(kept)
            if not self.store.keep_descriptor(
                named,
                descriptor.issued_at,
                descriptor.expires_at,
                document.model_dump_json(),
                stale=stale,
            ):
                return False
            self.signers[named] = vouched.signer
            return True

    def _check_descends(
        self,
        named: str,
        vouched: Vouched[ShufflerDescriptor],
        kept: dict[str, tuple[int, str]],
    ) -> None:
        """Refuse a descriptor whose keys do not pass through the signer of the kept one (a
        fork from an older key the shuffler rotated away from).

        Raises:
            CollectionConfigError: naming the shuffler and the key it moved to.
        """
        if named not in kept:
            return
        document = SignedDescriptor.model_validate_json(kept[named][1])
        try:
            moved = verify_descriptor_chain(document, self._keys[named], None).signer
        except CollectionConfigError:  # kept under a key no longer pinned: it binds nothing
            return
        if public_bytes(moved) not in {public_bytes(k) for k in vouched.lineage}:
            raise CollectionConfigError(
                f"descriptor of shuffler {named[:64]!r} is signed by a key that does not descend "
                f"from the one it moved to ({fingerprint(moved)}): a fork from an older key"
            )

    def renew_signer(self, shuffler_id: str) -> Ed25519PublicKey | None:
        """After a batch of ``shuffler_id`` failed to verify: its signer as the newest kept
        descriptor names it (another worker may have fetched one), and a fetch of every
        descriptor soon; None when the signer did not change, or it was looked for less than
        ``renew_seconds`` ago."""
        now = time.monotonic()
        last = self._renewed.get(shuffler_id, -math.inf)
        if shuffler_id not in self._keys or now - last < self.renew_seconds:
            return None
        self._renewed[shuffler_id] = now
        before = public_bytes(self.signers[shuffler_id])
        self._valid_now()
        self._wakes[shuffler_id].set()
        after = self.signers[shuffler_id]
        return None if public_bytes(after) == before else after

    def seed(self) -> None:
        """Follow the kept descriptors' signers, then offer the descriptors the registry came
        with (e.g. files the shufflers published)."""
        self._valid_now()
        for entry in self.entries:
            if entry.descriptor is None:
                continue
            try:
                self.offer(entry.descriptor)
            except CollectionConfigError as error:
                log.warning(
                    "registry descriptor refused", extra={"shuffler": entry.id, "error": str(error)}
                )

    def _valid_now(self) -> dict[str, SignedDescriptor]:
        """:meth:`_valid` of what the store keeps now (read and followed under the lock, so
        a fetch thread's older read never overwrites a newer signer)."""
        with self._lock:
            return self._valid(self.store.descriptors())

    def _valid(self, kept: dict[str, tuple[int, str]]) -> dict[str, SignedDescriptor]:
        """The kept descriptors that verify now with the key pinned for their shuffler (not
        expired, not signed by a key pinned before) and were not issued in the future beyond
        the clock skew (one would block every fresh descriptor: only a newer one replaces it).
        Each kept descriptor's signer becomes that shuffler's entry in :attr:`signers`, expired
        or not: a restart never falls back to a key the shuffler rotated away from."""
        valid, now = {}, self.clock()
        for entry in self.entries:
            if entry.id not in kept:
                continue
            document = SignedDescriptor.model_validate_json(kept[entry.id][1])
            pinned = self._keys[entry.id]
            try:
                self.signers[entry.id] = verify_descriptor_chain(document, pinned, None).signer
                found = verify_descriptor_chain(document, pinned, now)
            except CollectionConfigError:
                continue
            if found.value.issued_at <= now + MAX_CLOCK_SKEW_SECONDS:
                valid[entry.id] = document
        return valid

    def missing(self) -> list[str]:
        """Registered shufflers without a valid descriptor now (never fetched, or expired)."""
        valid = self._valid_now()
        return [e.id for e in self.entries if e.id not in valid]

    def current(self) -> list[SignedDescriptor]:
        """Every registered shuffler's descriptor, in registry order, each verified again
        with the key pinned for it now.

        Raises:
            ShufflersUnavailableError: naming the shufflers without a valid one.
        """
        valid = self._valid_now()
        missing = [e.id for e in self.entries if e.id not in valid]
        if missing:
            raise ShufflersUnavailableError(
                f"no valid signed descriptor yet from {', '.join(missing)}; retry shortly"
            )
        return [valid[e.id] for e in self.entries]

    def fetch_one(self, client: httpx.Client, entry: ShufflerEntry) -> bool:
        """Fetch ``entry``'s descriptor once, within :attr:`deadline_seconds` for the whole
        request; True if that shuffler has a valid descriptor now."""
        try:
            url = entry.url.rstrip("/") + "/v1/descriptor"
            document = _fetched(client, url, self.deadline_seconds)
            if descriptor_id(document) != entry.id:
                raise CollectionConfigError(
                    f"{entry.url} serves the descriptor of {descriptor_id(document)[:64]!r}"
                )
            self.offer(document)
        except (httpx.HTTPError, ValidationError, CollectionConfigError) as error:
            log.warning(
                "shuffler descriptor not fetched",
                extra={"shuffler": entry.id, "error": f"{type(error).__name__}: {error}"[:300]},
            )
        return entry.id not in self.missing()

    def start(self, refresh_seconds: float) -> None:
        """Fetch in one background thread per shuffler (one that answers slowly delays no
        other's): every :data:`RETRY_SECONDS` while its descriptor is missing, then every
        ``refresh_seconds``, and at once when :meth:`renew_signer` asks."""
        for entry in self.entries:
            thread = threading.Thread(
                target=self._run,
                args=(entry, refresh_seconds),
                name=f"esa-descriptor-{entry.id[:32]}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def _run(self, entry: ShufflerEntry, refresh_seconds: float) -> None:
        wake = self._wakes[entry.id]
        with deadline_client(self.deadline_seconds) as client:
            while not self._stop.is_set():
                try:
                    found = self.fetch_one(client, entry)
                except Exception:  # the database, mostly: the thread must survive it
                    log.exception("fetching a shuffler descriptor failed; retrying")
                    found = False
                wake.wait(refresh_seconds if found else RETRY_SECONDS)
                wake.clear()

    def stop(self) -> None:
        """Stop the background fetches (each ends within its fetch deadline)."""
        self._stop.set()
        for wake in self._wakes.values():
            wake.set()
        for thread in self._threads:
            thread.join(timeout=self.deadline_seconds + 1)


def _fetched(client: httpx.Client, url: str, seconds: float) -> SignedDescriptor:
    """A shuffler's descriptor, read up to :data:`MAX_DESCRIPTOR_BYTES` (an answer is read
    before its signature can be checked) within ``seconds`` for the whole request.

    Raises:
        httpx.HTTPError: a network failure, the deadline passed.
        CollectionConfigError: a non-200 or larger answer.
        ValidationError: not a signed descriptor.
    """
    try:
        fetched = fetch_within(client, url, MAX_DESCRIPTOR_BYTES, seconds)
    except FetchTooLargeError as error:
        raise CollectionConfigError(str(error)) from error
    if fetched.status != 200:
        raise CollectionConfigError(f"{url} answered HTTP {fetched.status}")
    return SignedDescriptor.model_validate_json(fetched.body)
