"""Sparse binary randomized response for encoders, drawn from :mod:`common.randomness`."""

from __future__ import annotations

import math
from collections.abc import Iterator

from common.randomness import RandomSource, bernoulli


def randomized_onehot(rng: RandomSource, value: int, k: int, flip: float) -> list[int]:
    """1-bits of binary RR (flip probability ``flip``) applied to the one-hot vector of value.

    The true bit is kept with probability ``1 - flip``; each of the other ``k - 1`` bits is set
    with probability ``flip``, drawn by geometric skipping. Sorted, so order reveals nothing.
    """
    ones = [pos if pos < value else pos + 1 for pos in geometric_positions(rng, k - 1, flip)]
    if not bernoulli(rng, flip):
        ones.append(value)
    return sorted(ones)


def geometric_positions(rng: RandomSource, length: int, p: float) -> Iterator[int]:
    """Positions in [0, length) that are independently selected with probability p, in order.

    Uses geometric skips (the gap before the next selected position is Geometric(p)), so the
    cost is proportional to the number of selected positions, not to ``length``: encoding a
    one-hot k-RAPPOR report with k = 1.7 million costs O(k p) draws.
    """
    if p <= 0.0 or length <= 0:
        return
    if p >= 1.0:
        yield from range(length)
        return
    log_keep = math.log1p(-p)
    position = -1
    while True:
        u = 1.0 - rng.random()  # in (0, 1]
        position += 1 + int(math.log(u) / log_keep)
        if position >= length:
            return
        yield position
