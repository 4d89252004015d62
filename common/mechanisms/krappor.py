"""k-RAPPOR with attribute fragments — ESA-revisited Algorithm 1, §III (docs/mechanisms.md).

Binary randomized response on each bit of the one-hot encoding (flip ``p = 1/(1 + e^ε)``;
removal ε-LDP, replacement 2ε); only the indices of the 1-bits are sent, one fragment each,
drawn by geometric skipping in O(k p). Wire payload (code 1): ``uint32 bit index``. Estimator
``ĉ_j = ((e^ε + 1) S_j - n) / (e^ε - 1)`` (ESA-revisited §III). Central privacy (removal, per
attribute): Lemma II.6, Theorem III.1 and the binary-RR blanket bound. The device facet
(parameters, encoding, local privacy) is :mod:`common.mechanisms.device.krappor`.

Details: docs/mechanisms.md, "k-RAPPOR with attribute fragments".
"""

from __future__ import annotations

import math

import numpy as np

from common.accounting import BinaryRR
from common.mechanisms._estimates import (
    CountAccumulator,
    Estimate,
    FloatArray,
    IntArray,
    clip_estimate,
)
from common.mechanisms._histogram import IndexHistogram
from common.mechanisms._random import bit_law
from common.mechanisms.base import PrivacyDescription
from common.mechanisms.device.krappor import (
    MECHANISM_CODE,
    NAME,
    PAYLOAD_SIZE,
    KRapporDevice,
    KRapporParams,
)

__all__ = [
    "MECHANISM_CODE",
    "NAME",
    "PAYLOAD_SIZE",
    "KRappor",
    "KRapporDevice",
    "KRapporParams",
    "simulate_aggregate",
    "variance",
]


def variance(n: int, params: KRapporParams) -> float:
    """``Var(ĉ_j) = n p (1 - p) / (1 - 2p)²`` (the same for every bin)."""
    p = params.flip_prob
    return n * p * (1.0 - p) / (1.0 - 2.0 * p) ** 2


def simulate_aggregate(
    true_counts: IntArray, params: KRapporParams, rng: np.random.Generator
) -> CountAccumulator:
    """Sample the accumulator directly: ``S_j = Bin(c_j, 1 - p) + Bin(n - c_j, p)``."""
    counts = np.asarray(true_counts, dtype=np.int64)
    n = int(counts.sum())
    p = params.flip_prob
    sums = rng.binomial(counts, 1.0 - p) + rng.binomial(n - counts, p)
    return CountAccumulator(sums.astype(np.int64), n)


class KRappor(KRapporDevice, IndexHistogram[KRapporParams]):
    """k-RAPPOR with attribute fragments through the mechanism interface."""

    randomizer_type = BinaryRR

    def estimate(
        self, params: KRapporParams, accumulator: CountAccumulator, clip: bool = False
    ) -> Estimate:
        """Debiased counts with standard errors."""
        e = math.exp(params.eps)
        n = accumulator.n
        values = np.asarray(((e + 1.0) * accumulator.counts - n) / (e - 1.0), dtype=np.float64)
        std = np.full(params.k, math.sqrt(variance(n, params)))
        note = "k-RAPPOR debiasing, ESA-revisited §III" + (
            "; negatives clipped to 0" if clip else ""
        )
        return Estimate(
            values=clip_estimate(values, clip), std_errors=std, n=n, clipped=clip, note=note
        )

    def bin_count_law(self, params: KRapporParams, value: int, bins: tuple[int, int]) -> FloatArray:
        """Each bit is binary RR of its own attribute, independently (Algorithm 1)."""
        return np.outer(*(bit_law(value == b, params.flip_prob) for b in bins))

    def privacy(self, params: KRapporParams) -> PrivacyDescription:
        """Per-bit binary RR at ε (removal, per attribute; blanket pair, Balle et al. 2019)."""
        return PrivacyDescription(BinaryRR(), params.eps)
