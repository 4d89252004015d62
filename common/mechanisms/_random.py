"""Randomness for encoders: the OS CSPRNG by default, an injectable seeded source for tests.

Everything an encoder draws goes through :class:`RandomSource`, so the randomness that protects
users always comes from ``os.urandom`` (via :class:`secrets.SystemRandom`) unless a test passes
a :class:`SeededSource` explicitly. Simulations of whole populations (``simulate_aggregate``)
use numpy generators instead: they protect nobody.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Iterator
from typing import Protocol


class RandomSource(Protocol):
    """The draws an encoder needs."""

    def random(self) -> float:
        """Uniform float in [0, 1)."""
        ...

    def randbelow(self, upper: int) -> int:
        """Uniform integer in [0, upper)."""
        ...


class SystemSource:
    """OS CSPRNG (``secrets.SystemRandom``, backed by ``os.urandom``). The default."""

    def __init__(self) -> None:
        self._system = secrets.SystemRandom()

    def random(self) -> float:
        return self._system.random()

    def randbelow(self, upper: int) -> int:
        return secrets.randbelow(upper)


class SeededSource:
    """Deterministic source for tests and reproducible simulations. Never for real devices."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def random(self) -> float:
        return self._random.random()

    def randbelow(self, upper: int) -> int:
        return self._random.randrange(upper)


def default_source() -> RandomSource:
    """A fresh OS-CSPRNG source."""
    return SystemSource()


def bernoulli(rng: RandomSource, p: float) -> bool:
    """True with probability p."""
    return rng.random() < p


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
