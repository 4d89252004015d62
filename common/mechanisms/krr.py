"""k-ary randomized response — Hiding Among the Clones §4.1 (docs/mechanisms.md).

With probability ``(e^ε - 1)/(e^ε + k - 1)`` the true value is sent, otherwise a uniform value
in [0, k): the true value is reported w.p. ``a = e^ε/(e^ε + k - 1)``, each other value w.p.
``b = 1/(e^ε + k - 1)`` (replacement ε-LDP). One message per report. The device facet
(parameters, encoding, local privacy) is :mod:`common.mechanisms.device.krr`.

Wire payload: ``uint32 value`` (mechanism code 5).

Estimator: ``ĉ_v = (N_v - n b)/(a - b)``, ``Var(ĉ_v) = (c_v a(1-a) + (n - c_v) b(1-b))/(a - b)²``
(reported with the clipped estimate plugged in for ``c_v``).

Central privacy (replacement): FMT21 Corollary 4.2 and its numerical counterpart.
"""

from __future__ import annotations

import math

import numpy as np

from common.accounting import KaryRR
from common.mechanisms._estimates import (
    CountAccumulator,
    Estimate,
    FloatArray,
    IntArray,
    clip_estimate,
)
from common.mechanisms._histogram import IndexHistogram
from common.mechanisms.base import PrivacyDescription
from common.mechanisms.device.krr import MECHANISM_CODE, NAME, PAYLOAD_SIZE, KRRDevice, KRRParams

__all__ = [
    "KRR",
    "MECHANISM_CODE",
    "NAME",
    "PAYLOAD_SIZE",
    "KRRDevice",
    "KRRParams",
    "simulate_aggregate",
    "variance",
]


def variance(true_counts: FloatArray | IntArray, n: int, params: KRRParams) -> FloatArray:
    """Exact variance of ĉ for the given counts."""
    a, b = params.truth_prob, params.other_prob
    c = np.asarray(true_counts, dtype=np.float64)
    result: FloatArray = (c * a * (1 - a) + (n - c) * b * (1 - b)) / (a - b) ** 2
    return result


def simulate_aggregate(
    true_counts: IntArray, params: KRRParams, rng: np.random.Generator
) -> CountAccumulator:
    """Truthful reports ~ Bin(c_v, keep); the rest are a multinomial over k uniform values."""
    counts = np.asarray(true_counts, dtype=np.int64)
    keep = math.expm1(params.eps) * params.other_prob
    truthful = rng.binomial(counts, keep)
    uniform = rng.multinomial(int(counts.sum() - truthful.sum()), np.full(params.k, 1.0 / params.k))
    return CountAccumulator((truthful + uniform).astype(np.int64), int(counts.sum()))


class KRR(KRRDevice, IndexHistogram[KRRParams]):
    """k-ary randomized response through the mechanism interface."""

    randomizer_type = KaryRR

    def estimate(
        self, params: KRRParams, accumulator: CountAccumulator, clip: bool = False
    ) -> Estimate:
        """Debiased counts with plug-in standard errors."""
        a, b, n = params.truth_prob, params.other_prob, accumulator.n
        values = np.asarray((accumulator.counts - n * b) / (a - b), dtype=np.float64)
        std = np.sqrt(variance(np.clip(values, 0, n), n, params))
        note = "k-RR debiasing" + ("; negatives clipped to 0" if clip else "")
        return Estimate(
            values=clip_estimate(values, clip), std_errors=std, n=n, clipped=clip, note=note
        )

    def bin_count_law(self, params: KRRParams, value: int, bins: tuple[int, int]) -> FloatArray:
        """One message: the value w.p. e^ε/(e^ε + k − 1), each other w.p. 1/(e^ε + k − 1)
        (§4.1), so the two bins are never both named."""
        p_a, p_b = (params.truth_prob if value == b else params.other_prob for b in bins)
        return np.array([[1.0 - p_a - p_b, p_b], [p_a, 0.0]])

    def privacy(self, params: KRRParams) -> PrivacyDescription:
        """Replacement, FMT21 Corollary 4.2 and the k-RR pair with its weight (§4.1)."""
        return PrivacyDescription(KaryRR(k=params.k), params.eps)
