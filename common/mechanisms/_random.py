"""Sparse binary randomized response for encoders (draws from :mod:`common.randomness`), and
the exact laws of its bits that audits fit to."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

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


def bit_law(own: bool, flip: float) -> npt.NDArray[np.float64]:
    """Law ``[P(0), P(1)]`` of a bit of binary RR that is 1 when ``own`` and flipped w.p.
    ``flip``."""
    one = 1.0 - flip if own else flip
    return np.array([1.0 - one, one])


def binomial_pmf(n: int, p: float) -> npt.NDArray[np.float64]:
    """``P(Bin(n, p) = i)`` for i = 0..n."""
    return np.array([math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(n + 1)])
