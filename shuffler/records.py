"""Plain records passed between the shuffler's layers (intake → store → batcher → forwarder),
and the stored packing of a contribution's fragments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from common.envelope import Contribution


@dataclass(frozen=True, slots=True)
class Pending:
    """A validated contribution on its way to the database."""

    client_id: str
    contribution: Contribution
    received_at: float


class Conflict(StrEnum):
    """Why the database did not take a contribution (its unique constraints)."""

    REPLAYED_NONCE = "replayed_nonce"
    OVER_QUOTA = "over_quota"
    REVOKED = "revoked"  # revoked at another replica since this one loaded its revocations
    CLOSED = "closed"  # its epoch closed at another replica (admin close) since this one checked


@dataclass(frozen=True, slots=True, order=True)
class GroupKey:
    """One group of Algorithm 3 (ESA-revisited §V): a (channel, crowd, epoch)."""

    channel_id: str
    crowd_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class SealedPart:
    """One signed part of a batch, ready to be stored and forwarded (only counts, no
    identifiers): the exact body bytes and their Ed25519 signature."""

    batch_id: str
    part: int
    body: bytes
    signature: str


@dataclass(frozen=True, slots=True)
class PartKey:
    """A stored batch part awaiting delivery, before a forwarder claims it."""

    batch_id: str
    part: int


@dataclass(frozen=True, slots=True)
class DuePart:
    """A batch part claimed by one forwarder (leased until its attempt is recorded)."""

    batch_id: str
    part: int
    body: bytes
    signature: str
    attempts: int


def pack_fragments(fragments: Sequence[bytes]) -> bytes:
    """``u16 length | bytes`` per fragment (fragments are at most 65,535 bytes)."""
    return b"".join([len(f).to_bytes(2, "big") + f for f in fragments])


@dataclass(frozen=True, slots=True)
class EpochGroups:
    """What a channel's owner may see of one (channel, epoch) at a shuffler: how many groups
    Algorithm 3 released, held and aborted, and the sizes of the released ones alone
    (a group's size and deletions are secret until its batch is released: docs/protocol.md,
    "What never leaves a party").
    ``received`` = ``deleted`` + ``batched``; ``forwarded`` of the batched contributions are in
    batches every part of which the analyzer acknowledged."""

    channel_id: str
    epoch: int
    released: int
    held: int
    aborted: int
    received: int
    deleted: int
    batched: int
    forwarded: int
