"""Randomness that protects users: the OS CSPRNG by default, an injectable seeded source for tests.

Everything an encoder or a shuffler draws goes through :class:`RandomSource`, so the randomness
that protects users always comes from ``os.urandom`` (via :mod:`secrets`) unless a test passes
a :class:`SeededSource` explicitly. Simulations of whole populations (``simulate_aggregate``)
use numpy generators instead: they protect nobody.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import MutableSequence
from typing import Protocol, TypeVar

T = TypeVar("T")


class RandomSource(Protocol):
    """The draws an encoder or a shuffler needs."""

    def random(self) -> float:
        """Uniform float in [0, 1)."""
        ...

    def randbelow(self, upper: int) -> int:
        """Uniform integer in [0, upper)."""
        ...


class SystemSource:
    """OS CSPRNG (``secrets``, backed by ``os.urandom``). The default everywhere."""

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


def uniform_open(rng: RandomSource) -> float:
    """Uniform in (0, 1] (never 0, so its logarithm is finite)."""
    return 1.0 - rng.random()


def laplace(rng: RandomSource, scale: float) -> float:
    """Laplace(scale) as the difference of two exponentials."""
    return scale * (math.log(uniform_open(rng)) - math.log(uniform_open(rng)))


def shuffle(rng: RandomSource, items: MutableSequence[T]) -> None:
    """In-place Fisher–Yates with ``rng.randbelow`` (never numpy's or ``random``'s default)."""
    for i in range(len(items) - 1, 0, -1):
        j = rng.randbelow(i + 1)
        items[i], items[j] = items[j], items[i]
