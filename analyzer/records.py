"""What passes between the analyzer's store and its layers: the stored rows as values (a part's
header, a batch's receipt, a channel-log row, a ledger row, an epoch's health) and the steps a
fold runs inside its transaction (:class:`PartFolding`, :data:`Charge`).

Plain frozen values, no SQL: :mod:`analyzer.store` reads and writes them
(docs/architecture.md, "Analyzer internals").
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

from common.wire import Bound


@dataclass(frozen=True, slots=True)
class ChannelLogRow:
    """One row of the channel log: ``add`` (with the config as JSON) or ``retire``."""

    version: int
    channel_id: str
    action: str
    config: str | None
    retired_from_epoch: int | None


@dataclass(frozen=True, slots=True)
class PartHeader:
    """What a stored part says about itself (docs/protocol.md, "Batches and parts"); its
    fragments stay in the stored body until they are opened."""

    batch_id: str
    part: int
    parts: int
    shuffler_id: str
    channel_id: str
    crowd_id: str
    epoch: int
    n_contributions: int
    n_fragments: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A complete batch's statistics with its verified crowd in them, the verified crowd, and
    whether it may be released (False: below its channel's ``min_crowd``, withheld)."""

    state: bytes
    verified: int
    released: bool


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """What intake checks a new part against: its batch's parts stored so far, and another
    batch already received for the same group (shuffler, channel, crowd, epoch), if any."""

    parts: list[PartHeader]
    rival: str | None


@dataclass(frozen=True, slots=True)
class CrowdCheck:
    """Claimed against verified crowds over a channel's complete batches in a range, and the
    batches withheld because their verified crowd is below ``min_crowd``."""

    batches: int
    claimed: int
    verified: int
    invalid: int
    short: int
    withheld: int


@dataclass(frozen=True, slots=True)
class PartStatus:
    """Where a stored part stands: ``stored``, ``opened`` or ``quarantined``, with its failed
    openings and the last one's error."""

    status: str
    attempts: int
    last_error: str | None


class BatchProgress(NamedTuple):
    """An incomplete batch: parts opened, parts in all, parts quarantined (never opened)."""

    opened: int
    parts: int
    quarantined: int = 0


class FragmentCounts(NamedTuple):
    """A channel's fragments in opened parts: opened (decrypted), and failed to open or parse
    (``invalid``; a fragment that opened but did not parse is in both)."""

    opened: int
    invalid: int


class Folded(Enum):
    """What folding one part did: added it to its open batch, or completed the batch."""

    PART = "part"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class BatchReceipt:
    """What the receipt of an accepted batch records (its fragments go to the accumulator)."""

    batch_id: str
    shuffler_id: str
    channel_id: str
    crowd_id: str
    epoch: int
    n_contributions: int
    n_fragments: int
    n_verified: int


@dataclass(frozen=True, slots=True)
class StoredState:
    """One accumulator row in a release's range."""

    epoch: int
    shuffler_id: str
    state: bytes


@dataclass(frozen=True, slots=True)
class ReceivedRange:
    """What a release may read: accumulators and the crowd size of every batch behind them."""

    states: list[StoredState]
    batch_sizes: dict[tuple[int, str], tuple[int, ...]]


class Group(NamedTuple):
    """One (channel, crowd, epoch): what each shuffler sends at most one batch for."""

    channel_id: str
    crowd_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class DeliveredBatch:
    """A complete batch as its receipt records it: its group's epoch, its shuffler, the crowd
    it claims and the one it verifies, its fragments that failed to open or parse, and whether
    it was withheld below ``min_crowd``."""

    epoch: int
    shuffler_id: str
    claimed: int
    verified: int
    invalid: int
    withheld: bool


#: The charge of one epoch from everything received in it: certificates as JSON (None: nothing
#: a certificate can rest on yet).
Charge = Callable[[ReceivedRange], str | None]


class PartFolding(Protocol):
    """The domain steps :meth:`analyzer.store.AnalyzerStore.fold_part` runs inside its
    transaction, for one opened part (:class:`analyzer.opening.PartFold`); each may run again
    when the transaction is retried, and what the one that committed computed is what counts."""

    def fold(self, state: bytes | None, repeated: Collection[int]) -> tuple[bytes, int]:
        """The part folded into its batch's statistics (``state`` None when new), the fragments
        at positions ``repeated`` (counted before in the epoch) left out: (new state, invalid
        fragments, the repeated ones included)."""
        ...

    def complete(self, state: bytes, valid: int, invalid: int) -> Completion:
        """The batch whose last part was folded: its verified crowd entered in its statistics."""
        ...

    def merge(self, state: bytes | None, batch: bytes) -> bytes:
        """A complete batch's statistics merged into its accumulator (``state`` None when new)."""
        ...

    def charge(self, received: ReceivedRange) -> str | None:
        """The epoch's charge from everything received in it (:data:`Charge`)."""
        ...


@dataclass(frozen=True, slots=True)
class StoredCharge:
    """One (channel, crowd, epoch) row of the privacy ledger."""

    channel_id: str
    crowd_id: str
    epoch: int
    certificate: str
    batches: int
    charged_at: float


@dataclass(frozen=True, slots=True)
class StoredRelease:
    """One ledger entry as stored."""

    id: int
    epoch_from: int
    epoch_to: int
    n: int
    certificate: Bound
    released_at: float


class CompleteEpoch(NamedTuple):
    """A (channel, epoch)'s complete batches: how many, how many withheld, the crowd they
    claim and the one they verify, and their fragments that failed to open or parse."""

    batches: int = 0
    withheld: int = 0
    claimed: int = 0
    verified: int = 0
    invalid: int = 0


class IncompleteEpoch(NamedTuple):
    """A (channel, epoch)'s incomplete batches: how many, the crowd they claim, and their
    parts quarantined."""

    batches: int = 0
    claimed: int = 0
    quarantined: int = 0


@dataclass(frozen=True, slots=True)
class EpochHealth:
    """What a channel's owner sees of one (channel, epoch) at the analyzer, all of it about
    batches received, so about groups the shufflers released: ``received`` is the crowd every
    batch claims (summed over shufflers, complete or not), ``verified`` the crowd the complete
    ones verify (withheld ones too), ``fragments_invalid`` the fragments of complete batches
    that failed to open or parse (chaff), ``releases`` the published releases whose epoch range
    includes the epoch."""

    channel_id: str
    epoch: int
    received: int
    verified: int
    batches_complete: int
    batches_withheld: int
    batches_incomplete: int
    parts_quarantined: int
    fragments_invalid: int
    releases: int
