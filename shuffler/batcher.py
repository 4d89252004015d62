"""Randomized report deletion and the shuffle: ESA-revisited (Girgis et al.) §V, Algorithm 3.

Pure: no database, no clock, no network. Per (channel, crowd, epoch) group the noise is drawn
ONCE (a group is never evaluated twice with fresh noise, which would average it away):

    n̂ = max(n + Laplace(2/ε_cr) − (2/ε_cr)·ln(2/δ_cr), 0)

if ``n̂ > n`` the group is aborted (all deleted); if ``⌊n̂⌋ < min_crowd`` it is held (never
released, deleted at retention expiry); otherwise ``n − ⌊n̂⌋`` uniformly chosen WHOLE
contributions are deleted, and the survivors' fragments are flattened and shuffled
(Fisher–Yates). Theorem V.1 gives the (ε_cr, δ_cr) protection of the released count.

All randomness comes from an injected :class:`~common.randomness.RandomSource` that defaults to
the OS CSPRNG (PROTOCOL.md: ``secrets``-grade, never numpy's PCG64); tests pass a seeded one.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common import randomness
from common.envelope import sign
from common.randomness import RandomSource
from common.wire import PART_FRAGMENTS, Batch, ChannelPolicy, b64
from shuffler.records import GroupKey, SealedPart, ShuffledBatch, unpack_fragments


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
class Evaluation:
    """Algorithm 3 applied to one group: the outcome and, when released, the shuffled batch."""

    deletion: Deletion
    batch: ShuffledBatch | None


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


def shuffled_fragments(survivors: list[bytes], rng: RandomSource) -> list[bytes]:
    """The survivors' packed fragments, flattened and shuffled uniformly (Fisher–Yates)."""
    fragments = [f for blob in survivors for f in unpack_fragments(blob)]
    randomness.shuffle(rng, fragments)
    return fragments


def part_count(fragments: int, part_fragments: int) -> int:
    """Parts of a batch of ``fragments`` cut into parts of at most ``part_fragments`` (an empty
    batch is still one part, so the analyzer learns its count).

    Raises:
        ValueError: if ``fragments`` < 0 or ``part_fragments`` < 1.
    """
    if fragments < 0 or part_fragments < 1:
        raise ValueError(
            f"need fragments >= 0, part_fragments >= 1, got {fragments=}, {part_fragments=}"
        )
    return max(1, math.ceil(fragments / part_fragments))


@dataclass
class Batcher:
    """Applies Algorithm 3 to groups, shuffles the released ones once, and seals their
    shuffled sequence as signed parts of at most ``part_fragments`` fragments."""

    shuffler_id: str
    signing_key: Ed25519PrivateKey
    rng: RandomSource = field(default_factory=randomness.default_source)
    part_fragments: int = PART_FRAGMENTS

    def __post_init__(self) -> None:
        if self.part_fragments < 1:
            raise ValueError(f"part_fragments must be >= 1, got {self.part_fragments}")

    def evaluate(self, key: GroupKey, blobs: list[bytes], policy: ChannelPolicy) -> Evaluation:
        """Algorithm 3 over one group's packed contributions (one noise draw), then the
        survivors' fragments flattened and shuffled once."""
        deletion = randomized_deletion(len(blobs), policy, self.rng)
        if deletion.status is not GroupStatus.RELEASED:
            return Evaluation(deletion, None)
        order = list(range(len(blobs)))
        randomness.shuffle(self.rng, order)
        survivors = [blobs[i] for i in order[: deletion.kept]]
        fragments = shuffled_fragments(survivors, self.rng)
        return Evaluation(deletion, ShuffledBatch(secrets.token_hex(16), len(survivors), fragments))

    def seal(self, key: GroupKey, batch: ShuffledBatch) -> Iterator[SealedPart]:
        """The batch's signed parts, one at a time: consecutive slices of the shuffled sequence
        (order inside it carries nothing, so cutting it reveals nothing), each body built and
        signed from its slice alone so no whole-batch body ever exists in memory. Every part
        carries the whole group's ``n_contributions`` (PROTOCOL.md, ``POST /v1/batches``)."""
        parts = part_count(len(batch.fragments), self.part_fragments)
        for part in range(parts):
            start = part * self.part_fragments
            body = Batch(
                batch_id=batch.batch_id,
                part=part,
                parts=parts,
                shuffler_id=self.shuffler_id,
                channel_id=key.channel_id,
                crowd_id=key.crowd_id,
                epoch=key.epoch,
                n_contributions=batch.n_contributions,
                fragments=[b64(f) for f in batch.fragments[start : start + self.part_fragments]],
            ).body()
            yield SealedPart(batch.batch_id, part, body, b64(sign(body, self.signing_key)))


def due(
    policy: ChannelPolicy, epoch: int, count: int, now: float, grace: float, closed_upto: int
) -> bool | None:
    """When a group is evaluated: ``True`` (final) once its epoch closed (after ``grace``
    seconds, or closed by an admin), ``False`` (a full part) at ``max_batch`` contributions,
    else ``None`` (not yet)."""
    closes_at = (epoch + 1) * policy.epoch_seconds + grace
    if now >= closes_at or epoch <= closed_upto:
        return True
    if count >= policy.max_batch:
        return False
    return None
