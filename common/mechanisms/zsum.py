"""Balcer–Cheu zero-sum histogram — *Separating Local & Shuffled DP*, Figures 1–2, Theorem 12.

For every bin j a user sends ``b_j + Ber(p)`` copies of "j", ``p`` fixed by the channel's
*declared* crowd and per-bin δ (δ/2: the histogram is (2ε, δ)-DP, replacement); configurations
outside Theorem 11's regime are refused, and the domain is capped at ``MAX_BINS``. Wire
payload (code 4): ``uint32 bin``. The estimate ``|y_j| - m p`` at the received crowd ``m`` is
unbiased; Figure 1's truncation is kept beside it (``Estimate.truncated``), never in its place.
The device facet (parameters, encoding) is :mod:`common.mechanisms.device.zsum`.

Details: docs/mechanisms.md, "Balcer–Cheu zero-sum histogram".
"""

from __future__ import annotations

import math

import numpy as np

from common.accounting import BalcerCheuNoise, Certification
from common.mechanisms._estimates import CountAccumulator, Estimate, FloatArray, IntArray
from common.mechanisms._histogram import IndexHistogram
from common.mechanisms.base import PrivacyDescription
from common.mechanisms.device.zsum import (
    MAX_BINS,
    MECHANISM_CODE,
    NAME,
    PAYLOAD_SIZE,
    ZSumDevice,
    ZSumParams,
)

__all__ = [
    "MAX_BINS",
    "MECHANISM_CODE",
    "NAME",
    "PAYLOAD_SIZE",
    "ZSum",
    "ZSumDevice",
    "ZSumParams",
    "simulate_aggregate",
    "variance",
]


def variance(m: int, params: ZSumParams) -> float:
    """``m p (1 - p)`` for bins far from the truncation point."""
    p = params.noise_prob
    return m * p * (1.0 - p)


def simulate_aggregate(
    true_counts: IntArray, params: ZSumParams, rng: np.random.Generator
) -> CountAccumulator:
    """``|y_j| = c_j + Bin(m, p)``."""
    counts = np.asarray(true_counts, dtype=np.int64)
    m = int(counts.sum())
    noise = rng.binomial(m, params.noise_prob, size=params.d)
    return CountAccumulator((counts + noise).astype(np.int64), m)


class ZSum(ZSumDevice, IndexHistogram[ZSumParams]):
    """The Balcer–Cheu zero-sum histogram through the mechanism interface.

    It has no dominating pair (its noise is calibrated to a declared crowd, Theorem 12), so
    :meth:`epoch_pair` finds none and the ledger composes each epoch's certificate.
    """

    randomizer_type = BalcerCheuNoise

    def estimate(self, params: ZSumParams, accumulator: CountAccumulator) -> Estimate:
        """The unbiased count ``|y_j| - m p`` per bin, with Figure 1's truncated analyzer (bins
        with ``|y_j| <= m`` reported as 0) beside it."""
        m = accumulator.n
        counts = accumulator.counts.astype(np.float64)
        values: FloatArray = counts - m * params.noise_prob
        truncated: FloatArray = np.where(counts > m, values, 0.0)
        std = np.full(params.d, math.sqrt(variance(m, params)))
        zeroed = int(np.count_nonzero((counts <= m) & (values != 0.0)))
        note = (
            "unbiased |y_j| - m p (Balcer-Cheu); Figure 1's truncated estimate, beside it, "
            f"zeroes {zeroed} of {params.d} bins (those at or below the crowd m = {m})"
        )
        return Estimate(
            values=values, std_errors=std, n=m, clipped=False, note=note, truncated=truncated
        )

    def bin_count_law(self, params: ZSumParams, value: int, bins: tuple[int, int]) -> FloatArray:
        """Per bin: a Ber(p) noise message, plus one for the user's own bin (Figure 2)."""
        p = params.noise_prob

        def count(own: bool) -> FloatArray:
            return np.array([0.0, 1.0 - p, p]) if own else np.array([1.0 - p, p, 0.0])

        return np.outer(*(count(value == b) for b in bins))

    def privacy(self, params: ZSumParams) -> PrivacyDescription:
        """Balcer–Cheu Theorem 12 at the per-bin ε, its noise sized for the declared crowd."""
        noise = BalcerCheuNoise(n_declared=params.n, delta=params.delta)
        return PrivacyDescription(noise, params.eps)

    def certify_crowd(self, params: ZSumParams, n: int, delta: float) -> Certification:
        """(2ε', δ) at a received crowd n (ε' = ε sqrt(n_declared/n)) at the channel's own δ:
        Theorem 12 fixes δ with the noise, so the release's ``delta`` cannot change it (the
        certificate states the δ it holds for)."""
        return self.privacy(params).certify(n, params.delta)
