"""Batch intake (PROTOCOL.md, ``POST /v1/batches``): verify, open, accumulate.

The Ed25519 signature over the exact body must verify against the registered key of the
shuffler the body names; batches below the channel's minimum crowd, for unknown channels, or
with more fragments than their contributions can carry are inconsistent; a known ``batch_id``
is acknowledged again but counted once. Every fragment is opened with any live analyzer key and
parsed by the channel's mechanism; fragments that fail either are chaff, counted and never
fatal. The accumulator update, the receipt and the epoch's ledger row (its certificate at the
crowds received, :meth:`ChannelRuntime.charge`) commit in one transaction (:mod:`analyzer.store`).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from analyzer.channels import ChannelRuntime
from analyzer.errors import (
    BadSignatureError,
    BatchForUnknownChannelError,
    BatchTooLargeError,
    BelowMinCrowdError,
    InconsistentCountsError,
    MalformedBatchError,
    UnknownShufflerError,
)
from analyzer.metrics import Events
from analyzer.store import AnalyzerStore, BatchReceipt, Fold
from common.envelope import EnvelopeError, KeyRing, open_fragment, verify
from common.wire import Batch

log = logging.getLogger("esa.analyzer")


@dataclass(frozen=True, slots=True)
class Intake:
    """What happened to one batch: fragments opened and parsed, and chaff (``invalid``)."""

    batch_id: str
    duplicate: bool
    opened: int = 0
    invalid: int = 0


@dataclass(frozen=True, slots=True)
class IntakePolicy:
    """Who may send batches, and how large they may be."""

    ring: KeyRing
    channels: Mapping[str, ChannelRuntime]
    shufflers: Mapping[str, Ed25519PublicKey]
    max_batch_bytes: int


class BatchIntake:
    """Verifies signed batches and folds their fragments into the store."""

    def __init__(self, store: AnalyzerStore, policy: IntakePolicy, events: Events) -> None:
        self.store = store
        self.policy = policy
        self.events = events

    def accept(self, body: bytes, signature: str | None) -> Intake:
        """Verify, open and accumulate one batch (idempotent by ``batch_id``).

        Raises:
            BatchTooLargeError: body over ``max_batch_bytes``.
            MalformedBatchError, UnknownShufflerError, BadSignatureError: not a verified batch.
            InconsistentBatchError: a batch its channel cannot hold.
            StorageConflictError: concurrent writers kept colliding.
        """
        if len(body) > self.policy.max_batch_bytes:
            raise BatchTooLargeError(f"batch exceeds {self.policy.max_batch_bytes} bytes")
        if not signature:
            raise BadSignatureError("ESA-Signature header required")
        batch = self._verified(body, signature)
        runtime = self._runtime(batch)
        if self.store.known(batch.batch_id):
            return self._duplicate(batch)
        opened = self._open(batch)
        undecryptable = len(batch.fragments) - len(opened)
        unparsed = self.store.accumulate(
            _receipt(batch), _folder(runtime, batch, opened), runtime.charge
        )
        if unparsed is None:
            return self._duplicate(batch)
        intake = Intake(batch.batch_id, False, len(opened) - unparsed, undecryptable + unparsed)
        self._record(batch, intake, len(opened))
        return intake

    def _verified(self, body: bytes, signature: str) -> Batch:
        try:
            batch = Batch.model_validate_json(body)
        except ValidationError as error:
            raise MalformedBatchError(f"not a batch: {_problems(error)}") from error
        key = self.policy.shufflers.get(batch.shuffler_id)
        if key is None:
            raise UnknownShufflerError(f"shuffler {batch.shuffler_id!r} is not registered")
        try:
            raw = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError) as error:
            raise BadSignatureError("ESA-Signature is not base64") from error
        if not verify(body, raw, key):
            raise BadSignatureError("signature does not verify for this shuffler")
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
        if len(batch.fragments) > batch.n_contributions * config.max_fragments:
            raise InconsistentCountsError(
                f"{len(batch.fragments)} fragments cannot come from {batch.n_contributions} "
                f"contributions of at most {config.max_fragments} fragments"
            )
        return runtime

    def _open(self, batch: Batch) -> list[bytes]:
        opened = []
        for text in batch.fragments:
            try:
                opened.append(
                    open_fragment(base64.b64decode(text), batch.channel_id, self.policy.ring)
                )
            except (EnvelopeError, binascii.Error, ValueError):
                continue
        return opened

    def _duplicate(self, batch: Batch) -> Intake:
        self.events.count("batches_duplicate")
        return Intake(batch.batch_id, True)

    def _record(self, batch: Batch, intake: Intake, opened: int) -> None:
        self.events.count("batches_accepted")
        self.events.count("fragments_opened", opened)
        self.events.count("fragments_invalid", intake.invalid)
        log.info(
            "batch accepted",
            extra={
                "batch_id": batch.batch_id,
                "channel": batch.channel_id,
                "epoch": batch.epoch,
                "n": batch.n_contributions,
                "invalid": intake.invalid,
            },
        )


def _receipt(batch: Batch) -> BatchReceipt:
    return BatchReceipt(
        batch_id=batch.batch_id,
        shuffler_id=batch.shuffler_id,
        channel_id=batch.channel_id,
        crowd_id=batch.crowd_id,
        epoch=batch.epoch,
        n_contributions=batch.n_contributions,
        n_fragments=len(batch.fragments),
    )


def _folder(runtime: ChannelRuntime, batch: Batch, opened: Sequence[bytes]) -> Fold:
    def fold(state: bytes | None) -> tuple[bytes, int]:
        accumulator = runtime.new_accumulator() if state is None else runtime.load(state)
        invalid = runtime.add(accumulator, opened, batch.n_contributions, batch.shuffler_id)
        return accumulator.to_bytes(), invalid

    return fold


def _problems(error: ValidationError) -> str:
    """The first validation problems as ``where: what`` (no Python repr in an answer)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in error.errors()[:2]
    )
