"""The exact laws of binary randomized response's bits that the shuffler audit fits to (the
encoders' draws: :mod:`common.mechanisms.device._random`)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt


def bit_law(own: bool, flip: float) -> npt.NDArray[np.float64]:
    """Law ``[P(0), P(1)]`` of a bit of binary RR that is 1 when ``own`` and flipped w.p.
    ``flip``."""
    one = 1.0 - flip if own else flip
    return np.array([1.0 - one, one])


def binomial_pmf(n: int, p: float) -> npt.NDArray[np.float64]:
    """``P(Bin(n, p) = i)`` for i = 0..n."""
    return np.array([math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(n + 1)])
