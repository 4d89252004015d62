"""Sealing one report for the wire: the one path the SDK and the load generator's simulated
devices take, so a simulated device sends exactly what a real one does (benchmarks that
replay pools of pre-sealed fragments say so).

docs/protocol.md, "Sealing": each fragment is sealed to the analyzer's HPKE key with the
(channel, epoch, crowd) context bound into ``info``; the fragments, the crowd and a fresh
nonce form one contribution, sealed to the chosen shuffler's key.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from common.envelope import (
    Contribution,
    FragmentContext,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.wire import ChannelConfig


def seal_report(
    config: ChannelConfig,
    *,
    crowd: str,
    epoch: int,
    fragments: Sequence[bytes],
    analyzer_key: X25519PublicKey,
    shuffler: tuple[str, X25519PublicKey],
) -> bytes:
    """The request body of one contribution: ``fragments`` sealed to the analyzer for this
    (channel, epoch, crowd), with a new nonce, sealed to ``shuffler`` = (id, HPKE key)."""
    context = FragmentContext(config.id, epoch, crowd)
    sealed = tuple(seal_fragment(f, context, config.payload_size, analyzer_key) for f in fragments)
    contribution = Contribution(
        channel_id=config.id, crowd_id=crowd, epoch=epoch, nonce=new_nonce(), fragments=sealed
    )
    return seal_contribution(contribution, *shuffler)


def shuffler_slot(slot: int | None, count: int, weights: Sequence[float] = ()) -> int:
    """Which of ``count`` shufflers a route goes to: ``slot mod count`` when the mechanism
    fixes it (report fragments), else one picked with the OS CSPRNG, in proportion to
    ``weights`` when given (a shuffler's share of the traffic), uniformly otherwise."""
    if slot is not None:
        return slot % count
    total = sum(weights)
    if not weights or total <= 0:
        return secrets.randbelow(count)
    point = secrets.randbelow(1 << 30) / (1 << 30) * total
    for index, weight in enumerate(weights):
        point -= weight
        if point < 0:
            return index
    return count - 1
