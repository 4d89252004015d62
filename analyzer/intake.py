"""Batch part intake (docs/protocol.md, "Batches and parts"): verify, check, store.

The shuffler named in ``ESA-Shuffler`` must first vouch for the request in its head
(``ESA-Preauth``, :mod:`common.preauth`: checked before an intake slot is taken, and the body
read checked against it); its Ed25519 signature must verify over the exact body
before any of it is parsed (at most the largest legal part is read). A verified part is refused
when its channel cannot hold it: unknown channel or crowd, below ``min_crowd``, an epoch that
starts beyond ``epoch_skew_seconds`` after the analyzer's clock, parts that
disagree, a second batch for one group, or more or fewer fragments than its contributions can
carry (``max_fragments`` and ``min_fragments`` per contribution, which every shuffler enforces).
A known (``batch_id``, ``part``) is acknowledged again but counted once. The raw body is stored
and acknowledged after the commit; :mod:`analyzer.opening` opens it in the background.

Every check and why: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from analyzer.channels import ChannelRuntime
from analyzer.errors import (
    BadPreauthError,
    BadSignatureError,
    BatchForUnknownChannelError,
    BatchTooLargeError,
    BelowMinCrowdError,
    DuplicateGroupError,
    FutureEpochError,
    InconsistentCountsError,
    MalformedBatchError,
    UnknownCrowdError,
    UnknownShufflerError,
)
from analyzer.metrics import AnalyzerEvents
from analyzer.records import PartHeader, StoredBatch
from analyzer.store import AnalyzerStore
from common.collection import MAX_CLOCK_SKEW_SECONDS, fingerprint
from common.envelope import KeyRing, verify
from common.preauth import Preauth, PreauthError, parse_preauth
from common.wire import Batch

log = logging.getLogger("esa.analyzer")

#: Bytes of an Ed25519 signature (RFC 8032, §5.1.6).
SIGNATURE_BYTES = 64
#: Largest ``part``, ``parts`` and ``n_contributions``: those columns are 32-bit ``Integer``
#: on PostgreSQL (a larger value would be a storage error there and silently stored on SQLite).
MAX_STORED_INT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class PartIntake:
    """What happened to one part: stored now, or known already (``duplicate``)."""

    batch_id: str
    part: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class IntakePolicy:
    """Who may send batches, and how large one part may be."""

    ring: KeyRing
    channels: Mapping[str, ChannelRuntime]
    shufflers: Mapping[str, Ed25519PublicKey]
    max_batch_bytes: int
    #: Reads the channels added at runtime again (a part may name one this replica has not
    #: folded in yet); returns the config revision.
    refresh_channels: Callable[[], int] = lambda: 0
    #: The signing key of a shuffler read again after its signature failed (it may have
    #: rotated: :meth:`analyzer.descriptors.ShufflerDescriptors.renew_signer`); None: unchanged.
    renew_signer: Callable[[str], Ed25519PublicKey | None] = lambda _: None
    clock: Callable[[], float] = time.time
    #: How far after :attr:`clock` an epoch a batch names may start (the parties' clock skew).
    epoch_skew_seconds: float = MAX_CLOCK_SKEW_SECONDS


class BatchIntake:
    """Verifies signed parts and stores them for :class:`analyzer.opening.PartOpener`."""

    def __init__(self, store: AnalyzerStore, policy: IntakePolicy, events: AnalyzerEvents) -> None:
        self.store = store
        self.policy = policy
        self.events = events

    def sender(self, shuffler_id: str | None) -> Ed25519PublicKey:
        """The key pinned for the shuffler an ``ESA-Shuffler`` header names (checked before
        the body is read).

        Raises:
            UnknownShufflerError: no header, or a shuffler that is not registered.
        """
        if not shuffler_id:
            raise UnknownShufflerError("ESA-Shuffler header required (the sending shuffler's id)")
        key = self.policy.shufflers.get(shuffler_id)
        if key is None:
            raise UnknownShufflerError(f"shuffler {shuffler_id[:64]!r} is not registered")
        return key

    def preauthorize(self, shuffler_id: str, header: str | None, cap: int) -> Preauth:
        """The ``ESA-Preauth`` header of a request claiming ``shuffler_id``, checked from the
        head alone (:mod:`common.preauth`) so that only the shuffler itself takes one of its
        intake slots: in its window, for a body no larger than ``cap``, signed by the shuffler's
        key (read again once if it may have rotated).

        Raises:
            BadPreauthError: missing, malformed, stale or not signed by the shuffler.
            BatchTooLargeError: it names a body over ``cap`` bytes.
        """
        key = self.sender(shuffler_id)
        try:
            preauth = parse_preauth(header)
            if preauth.length > cap:
                raise BatchTooLargeError(f"batch part exceeds {cap} bytes")
            try:
                preauth.check(shuffler_id, key, self.policy.clock())
            except PreauthError:
                renewed = self.policy.renew_signer(shuffler_id)
                if renewed is None:
                    raise
                preauth.check(shuffler_id, renewed, self.policy.clock())
        except PreauthError as error:
            raise BadPreauthError(str(error)) from error
        return preauth

    def accept(self, body: bytes, signature: str | None, shuffler_id: str | None) -> PartIntake:
        """Verify one part and store it durably (idempotent by (``batch_id``, ``part``)).

        Raises:
            BatchTooLargeError: body over ``max_batch_bytes``.
            UnknownShufflerError, BadSignatureError: not signed by the registered shuffler the
                ``ESA-Shuffler`` header names.
            MalformedBatchError: not a batch part (or it names another shuffler).
            InconsistentBatchError: a part its channel, or its batch's other parts, cannot hold.
        """
        key = self.sender(shuffler_id)
        if len(body) > self.policy.max_batch_bytes:
            raise BatchTooLargeError(f"batch part exceeds {self.policy.max_batch_bytes} bytes")
        raw = signature_bytes(signature)
        if not verify(body, raw, key):
            renewed = self.policy.renew_signer(str(shuffler_id))
            if renewed is None or not verify(body, raw, renewed):
                raise BadSignatureError("signature does not verify for this shuffler")
            key = renewed
        batch = _parsed(body)
        if batch.shuffler_id != shuffler_id:
            raise MalformedBatchError("a batch part must name the shuffler that signs it")
        runtime = self._runtime(batch)
        header = _header(batch)
        del batch
        if not self.store.store_part(
            header, body, lambda stored: _consistent(runtime, header, stored)
        ):
            self.events.count("batches_duplicate")
            return PartIntake(header.batch_id, header.part, True)
        self.events.count("parts_stored")
        log.info(
            "batch part stored",
            extra={
                "batch_id": header.batch_id,
                "part": header.part,
                "parts": header.parts,
                "channel": header.channel_id,
                "epoch": header.epoch,
                "n": header.n_contributions,
                "shuffler": header.shuffler_id,
                "signer": fingerprint(key),  # which of its keys (they rotate)
            },
        )
        return PartIntake(header.batch_id, header.part, False)

    def _runtime(self, batch: Batch) -> ChannelRuntime:
        runtime = self.policy.channels.get(batch.channel_id)
        if runtime is None:
            self.policy.refresh_channels()
            runtime = self.policy.channels.get(batch.channel_id)
        if runtime is None:
            raise BatchForUnknownChannelError(f"channel {batch.channel_id!r} is not configured")
        config = runtime.config
        if batch.n_contributions < config.min_crowd:
            raise BelowMinCrowdError(
                f"batch of {batch.n_contributions} contributions < min_crowd={config.min_crowd}"
            )
        start, latest = batch.epoch * config.epoch_seconds, self.policy.clock()
        if start > latest + self.policy.epoch_skew_seconds:
            raise FutureEpochError(
                f"epoch {batch.epoch} of channel {config.id!r} starts at {start}, more than "
                f"{self.policy.epoch_skew_seconds:g} s after this analyzer's clock "
                f"({int(latest)}): a shuffler sends a batch once its epoch closed"
            )
        if batch.crowd_id not in config.crowds:
            raise UnknownCrowdError(
                f"crowd {batch.crowd_id[:64]!r} is not declared by channel {config.id!r}"
            )
        return runtime


def signature_bytes(header: str | None) -> bytes:
    """The raw signature an ``ESA-Signature`` header carries (base64 of 64 bytes).

    Raises:
        BadSignatureError: if the header is missing or is not one base64 Ed25519 signature.
    """
    if not header:
        raise BadSignatureError("ESA-Signature header required")
    try:
        raw = base64.b64decode(header, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadSignatureError("ESA-Signature is not base64") from error
    if len(raw) != SIGNATURE_BYTES:
        raise BadSignatureError(
            f"ESA-Signature must be a {SIGNATURE_BYTES}-byte Ed25519 signature, "
            f"got {len(raw)} bytes"
        )
    return raw


def _parsed(body: bytes) -> Batch:
    """A verified body as a batch part.

    Raises:
        MalformedBatchError: naming the first problems.
    """
    try:
        batch = Batch.model_validate_json(body)
    except ValidationError as error:
        raise MalformedBatchError(f"not a batch: {_problems(error)}") from error
    _check_bounds(batch)
    return batch


def _check_bounds(batch: Batch) -> None:
    """Refuse numbers the tables cannot hold (the same answer on every database; strings are
    bounded by the configuration: registered shufflers, configured channels, declared
    crowds)."""
    for name in ("parts", "n_contributions"):
        if getattr(batch, name) > MAX_STORED_INT:
            raise MalformedBatchError(f"{name} must be <= {MAX_STORED_INT}")


def _header(batch: Batch) -> PartHeader:
    return PartHeader(
        batch_id=batch.batch_id,
        part=batch.part,
        parts=batch.parts,
        shuffler_id=batch.shuffler_id,
        channel_id=batch.channel_id,
        crowd_id=batch.crowd_id,
        epoch=batch.epoch,
        n_contributions=batch.n_contributions,
        n_fragments=len(batch.fragments),
    )


def _batch_fields(header: PartHeader) -> tuple[object, ...]:
    return (
        header.parts,
        header.shuffler_id,
        header.channel_id,
        header.crowd_id,
        header.epoch,
        header.n_contributions,
    )


def _consistent(runtime: ChannelRuntime, header: PartHeader, stored: StoredBatch) -> None:
    """A part must say what its batch's stored parts say, be its group's only batch, and all
    parts together must carry what the group's contributions can (docs/protocol.md, "Batches
    and parts" and "Who vouches for what")."""
    others = stored.parts
    if others and _batch_fields(header) != _batch_fields(others[0]):
        raise InconsistentCountsError(
            f"part {header.part} of batch {header.batch_id} disagrees with its stored parts "
            "on parts, shuffler, channel, crowd, epoch or n_contributions"
        )
    if stored.rival is not None:
        raise DuplicateGroupError(
            f"{header.shuffler_id} already sent batch {stored.rival} for channel "
            f"{header.channel_id!r}, crowd {header.crowd_id!r}, epoch {header.epoch}: a group is "
            "evaluated once"
        )
    config = runtime.config
    total = header.n_fragments + sum(o.n_fragments for o in others)
    n = header.n_contributions
    if total > n * config.max_fragments:
        raise InconsistentCountsError(
            f"{total} fragments cannot come from {n} contributions of at most "
            f"{config.max_fragments} fragments (the channel's max_fragments)"
        )
    complete = len({o.part for o in others} | {header.part}) == header.parts
    if complete and total < n * config.min_fragments:
        fixed = config.min_fragments == config.max_fragments
        exactly = f"{'exactly' if fixed else 'at least'} {config.min_fragments}"
        raise InconsistentCountsError(
            f"{total} fragments cannot come from {n} contributions of {exactly} fragments "
            "each (the channel's min_fragments, which shufflers enforce): the claimed crowd is "
            "not backed by fragments"
        )


def _problems(error: ValidationError) -> str:
    """The first validation problems as ``where: what`` (no Python repr in an answer)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in error.errors()[:2]
    )
