"""Randomized report deletion and the shuffle: ESA-revisited (Girgis et al.) §V, Algorithm 3.

Pure but for the streamed shuffle's temporary file; all draws come from an injected
:class:`~common.randomness.RandomSource` (the OS CSPRNG unless a test seeds one). A group is
evaluated once, whole, when its epoch closes; its noise is drawn ONCE, from its count alone:

    n̂ = max(n + Laplace(2/ε_cr) − (2/ε_cr)·ln(2/δ_cr), 0)

``n̂ > n`` aborts the group, ``⌊n̂⌋ < min_crowd`` holds it, else ``n − ⌊n̂⌋`` uniformly chosen
whole contributions are deleted and the survivors shuffled (:mod:`shuffler.dealing`); Theorem
V.1 gives the (ε_cr, δ_cr) protection. Outcomes in full: docs/shuffler.md, "Randomized deletion".
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common import randomness
from common.envelope import sign
from common.randomness import RandomSource
from common.wire import PART_FRAGMENTS, Batch, ChannelPolicy, b64
from shuffler.dealing import Deal, deal
from shuffler.records import GroupKey, SealedPart

Positions = npt.NDArray[np.int64]


class GroupStatus(StrEnum):
    """What Algorithm 3 did with a group."""

    RELEASED = "released"
    HELD = "held"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class Deletion:
    """Outcome of Algorithm 3 for one group of ``n`` contributions, ``kept`` of them released."""

    status: GroupStatus
    n: int
    kept: int

    @property
    def deleted(self) -> int:
        """Contributions removed now: all when aborted, none when held (retention deletes them)."""
        if self.status is GroupStatus.HELD:
            return 0
        return self.n if self.status is GroupStatus.ABORTED else self.n - self.kept


@dataclass(frozen=True, slots=True)
class ReleasedBatch:
    """A released group's batch as stored: ``fragments`` shuffled once, in ``parts`` parts."""

    batch_id: str
    n_contributions: int
    fragments: int
    parts: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Algorithm 3 applied to one group: the outcome and, when released, its batch."""

    deletion: Deletion
    batch: ReleasedBatch | None


@dataclass(frozen=True, slots=True)
class DealtBatch:
    """A batch being stored: what it is, and its signed parts, yielded once, one at a time."""

    batch: ReleasedBatch
    parts: Iterator[SealedPart]


def randomized_deletion(n: int, policy: ChannelPolicy, rng: RandomSource) -> Deletion:
    """ESA-revisited Algorithm 3 for one group of ``n`` contributions (one Laplace draw).

    Args:
        n: Contributions in the group (>= 0).
        policy: The channel's ``eps_cr``, ``delta_cr`` (Theorem V.1) and ``min_crowd``.
        rng: Source of the Laplace noise.

    Raises:
        ValueError: if ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got n={n}")
    scale = 2.0 / policy.eps_cr
    n_hat = max(n + randomness.laplace(rng, scale) - scale * math.log(2.0 / policy.delta_cr), 0.0)
    if n_hat > n:
        return Deletion(GroupStatus.ABORTED, n, 0)
    kept = math.floor(n_hat)
    if kept < policy.min_crowd:
        return Deletion(GroupStatus.HELD, n, 0)
    return Deletion(GroupStatus.RELEASED, n, kept)


@dataclass
class Batcher:
    """Algorithm 3 for one group at a time: the noise draw, the uniformly chosen survivors, and
    their fragments released as one shuffled sequence in signed parts of at most
    ``part_fragments`` fragments (:func:`shuffler.closing.close_group` feeds it the store's rows
    and stores what it yields).
    ``signer`` gives the key that signs, read at each release (a rotation changes it)."""

    shuffler_id: str
    signer: Callable[[], Ed25519PrivateKey]
    rng: RandomSource = field(default_factory=randomness.default_source)
    part_fragments: int = PART_FRAGMENTS

    def __post_init__(self) -> None:
        if self.part_fragments < 1:
            raise ValueError(f"part_fragments must be >= 1, got {self.part_fragments}")

    def decide(self, n: int, policy: ChannelPolicy) -> Deletion:
        """Algorithm 3's one noise draw for a group of ``n`` contributions (its count only)."""
        return randomized_deletion(n, policy, self.rng)

    def survivors(self, n: int, kept: int) -> Positions:
        """``kept`` uniformly chosen whole contributions of ``n``: the first ``kept`` positions
        of a Fisher–Yates permutation of ``range(n)`` (CSPRNG), returned sorted so the store
        reads them in its own order (the shuffle of their fragments makes order irrelevant).

        Raises:
            ValueError: unless 0 <= kept <= n.
        """
        if not 0 <= kept <= n:
            raise ValueError(f"need 0 <= kept <= n, got {kept=}, {n=}")
        order = list(range(n))
        randomness.shuffle(self.rng, order)
        return np.sort(np.array(order[:kept], dtype=np.int64))

    @contextmanager
    def release(
        self,
        key: GroupKey,
        n_contributions: int,
        fragments: int,
        chunks: Iterable[Sequence[bytes]],
        directory: Path | None = None,
    ) -> Iterator[DealtBatch]:
        """Deal the survivors' packed fragments (``chunks``, ``fragments`` of them as stored)
        into one uniformly random permutation (:func:`shuffler.dealing.deal`) and sign it as
        parts; the temporary file lives as long as the ``with`` block."""
        batch_id, signing_key = secrets.token_hex(16), self.signer()
        with deal(chunks, fragments, self.part_fragments, self.rng, directory) as dealt:
            batch = ReleasedBatch(batch_id, n_contributions, dealt.fragments, dealt.parts)
            yield DealtBatch(batch, self._sealed(key, batch, dealt, signing_key))

    def _sealed(
        self, key: GroupKey, batch: ReleasedBatch, dealt: Deal, signing_key: Ed25519PrivateKey
    ) -> Iterator[SealedPart]:
        """The signed parts, one at a time, each body built and signed from its own fragments
        (no whole-batch body ever exists). Every part carries the whole group's
        ``n_contributions`` (docs/protocol.md, "Batches and parts")."""
        for part, fragments in enumerate(dealt):
            body = Batch(
                batch_id=batch.batch_id,
                part=part,
                parts=batch.parts,
                shuffler_id=self.shuffler_id,
                channel_id=key.channel_id,
                crowd_id=key.crowd_id,
                epoch=key.epoch,
                n_contributions=batch.n_contributions,
                fragments=fragments.base64(),
            ).body()
            yield SealedPart(batch.batch_id, part, body, b64(sign(body, signing_key)))


def group_due(
    policy: ChannelPolicy, epoch: int, now: float, grace: float, closed_upto: int
) -> bool:
    """Whether a group is evaluated now: only once its epoch closed (``grace`` seconds after its
    end, or closed by an admin), and then whole, however many contributions it has."""
    return now >= closes_at(policy, epoch, grace) or epoch <= closed_upto


def closes_at(policy: ChannelPolicy, epoch: int, grace: float) -> float:
    """When an epoch closes by the clock: ``grace`` seconds after its end."""
    return (epoch + 1) * policy.epoch_seconds + grace
