"""Randomness that protects users: the OS CSPRNG by default, an injectable seeded source for tests.

Everything an encoder or a shuffler draws goes through :class:`RandomSource`, so the randomness
that protects users always comes from ``os.urandom`` (via :mod:`secrets`) unless a test passes
a :class:`SeededSource` explicitly. Simulations of whole populations (``simulate_aggregate``)
use numpy generators instead: they protect nobody. Bulk draws (:func:`bounded_integers`, the
shuffle) take their bits from the source in one call and vectorise the arithmetic with numpy,
never numpy's generators; they import numpy when first called, so a device, which draws only
scalars, never loads it (docs/sdk.md, "What importing costs").
"""

from __future__ import annotations

import math
import os
import random
import secrets
from collections.abc import MutableSequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

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

    def randbytes(self, n: int) -> bytes:
        return os.urandom(n)


class SeededSource:
    """Deterministic source for tests and reproducible simulations. Never for real devices."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def random(self) -> float:
        return self._random.random()

    def randbelow(self, upper: int) -> int:
        return self._random.randrange(upper)

    def randbytes(self, n: int) -> bytes:
        return self._random.randbytes(n)


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


def random_bytes(rng: RandomSource, n: int) -> bytes:
    """``n`` uniform bytes from ``rng``: its ``randbytes`` when it has one (both built-in
    sources: one ``os.urandom`` call for the OS CSPRNG), else one uniform integer below
    ``256**n``."""
    randbytes = getattr(rng, "randbytes", None)
    if randbytes is not None:
        return bytes(randbytes(n))
    return rng.randbelow(1 << (8 * n)).to_bytes(n, "little")


def bounded_integers(rng: RandomSource, bounds: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """One independent uniform integer in ``[0, bounds[i])`` per bound, exactly (no modulo bias).

    Rejection sampling on 64-bit words (Lemire's threshold): ``r mod b`` is uniform when ``r``
    is uniform on ``[t, 2**64)`` with ``t = 2**64 mod b``, a range whose length is a multiple
    of ``b``; words below ``t`` (probability < b / 2**64) are drawn again.

    Raises:
        ValueError: if a bound is 0.
    """
    import numpy as np

    bounds = np.asarray(bounds, dtype=np.uint64)
    if bounds.size and int(bounds.min()) < 1:
        raise ValueError(f"bounds must be >= 1, got min(bounds)={int(bounds.min())}")
    thresholds = (np.uint64(0) - bounds) % bounds  # 2**64 mod b, in wrapping uint64
    out = np.empty(bounds.shape, dtype=np.uint64)
    todo = np.arange(bounds.size)
    while todo.size:
        words = np.frombuffer(random_bytes(rng, 8 * todo.size), dtype="<u8").astype(np.uint64)
        good = words >= thresholds[todo]
        out[todo[good]] = words[good] % bounds[todo[good]]
        todo = todo[~good]
    return out


def uniform_integers(rng: RandomSource, upper: int, count: int) -> npt.NDArray[np.int64]:
    """``count`` independent uniform integers in ``[0, upper)`` (exact, see
    :func:`bounded_integers`).

    Raises:
        ValueError: if ``upper`` is not in [1, 2**63] or ``count`` < 0.
    """
    import numpy as np

    if not 1 <= upper <= 1 << 63 or count < 0:
        raise ValueError(f"need 1 <= upper <= 2**63 and count >= 0, got {upper=}, {count=}")
    return bounded_integers(rng, np.full(count, upper, dtype=np.uint64)).astype(np.int64)


def shuffle(rng: RandomSource, items: MutableSequence[T]) -> None:
    """In-place Fisher–Yates (Knuth's Algorithm P): position ``i`` swaps with a uniform
    ``j <= i``, every ``j`` drawn from ``rng`` in one batch (never numpy's or ``random``'s
    generators), so all ``len(items)!`` orders are equally likely."""
    import numpy as np

    size = len(items)
    if size < 2:
        return
    draws = bounded_integers(rng, np.arange(size, 1, -1, dtype=np.uint64)).tolist()
    for i, j in zip(range(size - 1, 0, -1), draws, strict=True):
        items[i], items[j] = items[j], items[i]
