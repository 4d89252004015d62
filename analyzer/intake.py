"""Batch part intake (PROTOCOL.md, ``POST /v1/batches``; issues 11 and 12): verify and store.

The Ed25519 signature over the exact body must verify against the registered key of the
shuffler the body names, and it is checked before the body is validated as a batch: an
ill-formed ``ESA-Signature`` is refused before anything is read (:func:`signature_bytes`, also
called by the HTTP edge before it streams the body), and only the ``shuffler_id`` is read from
an unverified body. Parts below the channel's minimum crowd, for unknown channels, that name a
crowd the channel does not declare, disagree with their batch's stored parts, or whose batch
carries more fragments than its contributions can are inconsistent; numbers beyond what the
tables hold are malformed (the same answer on SQLite and PostgreSQL); a known (``batch_id``,
``part``) is acknowledged again but counted once. The raw body is stored durably and
acknowledged right after the commit, whatever the batch's size; :mod:`analyzer.opening` opens
and accumulates it in the background (every fragment opened with any live analyzer key and
parsed by the channel's mechanism; fragments that fail either are chaff, counted and never
fatal).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, ValidationError

from analyzer.channels import ChannelRuntime
from analyzer.errors import (
    BadSignatureError,
    BatchForUnknownChannelError,
    BatchTooLargeError,
    BelowMinCrowdError,
    InconsistentCountsError,
    MalformedBatchError,
    UnknownCrowdError,
    UnknownShufflerError,
)
from analyzer.metrics import Events
from analyzer.store import AnalyzerStore, PartHeader
from common.envelope import KeyRing, verify
from common.wire import Batch

log = logging.getLogger("esa.analyzer")

#: Bytes of an Ed25519 signature (RFC 8032, §5.1.6).
SIGNATURE_BYTES = 64
#: Largest ``part``, ``parts`` and ``n_contributions``: those columns are 32-bit ``Integer``
#: on PostgreSQL (a larger value would be a storage error there and silently stored on SQLite).
MAX_STORED_INT = 2**31 - 1


class _Signer(BaseModel):
    """The one field read from a body before its signature is verified."""

    model_config = ConfigDict(extra="ignore")

    shuffler_id: str


@dataclass(frozen=True, slots=True)
class Intake:
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


class BatchIntake:
    """Verifies signed parts and stores them for :class:`analyzer.opening.PartOpener`."""

    def __init__(self, store: AnalyzerStore, policy: IntakePolicy, events: Events) -> None:
        self.store = store
        self.policy = policy
        self.events = events

    def accept(self, body: bytes, signature: str | None) -> Intake:
        """Verify one part and store it durably (idempotent by (``batch_id``, ``part``)).

        Raises:
            BatchTooLargeError: body over ``max_batch_bytes``.
            BadSignatureError: ``signature`` missing, ill-formed or not verifying.
            MalformedBatchError, UnknownShufflerError: not a verified part.
            InconsistentBatchError: a part its channel, or its batch's other parts, cannot hold.
        """
        if len(body) > self.policy.max_batch_bytes:
            raise BatchTooLargeError(f"batch part exceeds {self.policy.max_batch_bytes} bytes")
        batch = self._verified(body, signature_bytes(signature))
        runtime = self._runtime(batch)
        header = _header(batch)
        del batch
        if not self.store.store_part(
            header, body, lambda others: _consistent(runtime, header, others)
        ):
            self.events.count("batches_duplicate")
            return Intake(header.batch_id, header.part, True)
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
            },
        )
        return Intake(header.batch_id, header.part, False)

    def _verified(self, body: bytes, signature: bytes) -> Batch:
        """The batch, once the signature of the shuffler it names verifies (only
        ``shuffler_id`` is read before that)."""
        try:
            shuffler_id = _Signer.model_validate_json(body).shuffler_id
        except ValidationError as error:
            raise MalformedBatchError(f"not a batch: {_problems(error)}") from error
        key = self.policy.shufflers.get(shuffler_id)
        if key is None:
            raise UnknownShufflerError(f"shuffler {shuffler_id[:64]!r} is not registered")
        if not verify(body, signature, key):
            raise BadSignatureError("signature does not verify for this shuffler")
        try:
            batch = Batch.model_validate_json(body)
        except ValidationError as error:
            raise MalformedBatchError(f"not a batch: {_problems(error)}") from error
        _check_bounds(batch)
        return batch

    def _runtime(self, batch: Batch) -> ChannelRuntime:
        runtime = self.policy.channels.get(batch.channel_id)
        if runtime is None:
            raise BatchForUnknownChannelError(f"channel {batch.channel_id!r} is not configured")
        config = runtime.config
        if batch.n_contributions < config.min_crowd:
            raise BelowMinCrowdError(
                f"batch of {batch.n_contributions} contributions < min_crowd={config.min_crowd}"
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


def _consistent(runtime: ChannelRuntime, header: PartHeader, others: Sequence[PartHeader]) -> None:
    """A part must say what its batch's stored parts say, and all parts together may not carry
    more fragments than the group's contributions can (PROTOCOL.md, ``POST /v1/batches``)."""
    if others and _batch_fields(header) != _batch_fields(others[0]):
        raise InconsistentCountsError(
            f"part {header.part} of batch {header.batch_id} disagrees with its stored parts "
            "on parts, shuffler, channel, crowd, epoch or n_contributions"
        )
    total = header.n_fragments + sum(o.n_fragments for o in others)
    most = header.n_contributions * runtime.config.max_fragments
    if total > most:
        raise InconsistentCountsError(
            f"{total} fragments cannot come from {header.n_contributions} contributions of at "
            f"most {runtime.config.max_fragments} fragments"
        )


def _problems(error: ValidationError) -> str:
    """The first validation problems as ``where: what`` (no Python repr in an answer)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in error.errors()[:2]
    )
