"""Balcer–Cheu zero-sum histogram — *Separating Local & Shuffled DP*, Figures 1–2, Theorem 12.

For every bin j a user sends ``b_j + Ber(p)`` copies of "j", ``p`` fixed by the channel's
*declared* crowd and per-bin δ (δ/2: the histogram is (2ε, δ)-DP, replacement); configurations
outside Theorem 11's regime are refused, and the domain is capped at ``MAX_BINS``. Wire
payload (code 4): ``uint32 bin``. The estimate ``|y_j| - m p`` at the received crowd ``m`` is
unbiased; Figure 1's truncation is kept beside it (``Estimate.truncated``), never in its place.

Details: docs/mechanisms.md, "Balcer–Cheu zero-sum histogram".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.accounting import BalcerCheuNoise, Certification
from common.mechanisms._estimates import CountAccumulator, Estimate, FloatArray, IntArray
from common.mechanisms._histogram import (
    IndexHistogram,
    check_bins,
    check_value,
    index_fragment,
)
from common.mechanisms.base import BatchContext, FragmentCount, LocalPrivacy, PrivacyDescription
from common.randomness import RandomSource, bernoulli

NAME = "zsum"
MECHANISM_CODE = 4
PAYLOAD_SIZE = 4
#: Each user sends about d messages (Theorem 12 (iv)); larger domains belong to k-RAPPOR.
MAX_BINS = 1024


@dataclass(frozen=True, slots=True)
class ZSumParams:
    """Attributes: ``d`` bins, ``eps`` per-bin ε (<= 1), ``delta`` histogram δ, ``n`` crowd.

    Raises:
        ValueError: outside Theorem 11's regime or above ``MAX_BINS``, with the reason.
    """

    d: int
    eps: float
    delta: float
    n: int

    def __post_init__(self) -> None:
        check_bins("d", self.d, MAX_BINS + 1)
        if not (
            isinstance(self.eps, int | float) and math.isfinite(self.eps) and 0 < self.eps <= 1
        ):
            raise ValueError(
                f"eps must be in (0, 1] (Balcer-Cheu Theorem 11), got eps={self.eps!r}"
            )
        if not (isinstance(self.delta, int | float) and 0 < self.delta < 1):
            raise ValueError(f"delta must be in (0, 1), got delta={self.delta!r}")
        required = 100.0 * math.log(2.0 / self.bin_delta) / self.eps**2
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < required:
            raise ValueError(
                f"n must be >= 100 ln(2/δ_bin)/ε² = {math.ceil(required)} for eps={self.eps}, "
                f"delta={self.delta} (Balcer-Cheu Theorem 11), got n={self.n!r}"
            )

    @property
    def bin_delta(self) -> float:
        """Per-bin δ: half the histogram's δ (Theorem 12 composes two bins)."""
        return self.delta / 2.0

    @property
    def noise_prob(self) -> float:
        """``p = 1 - 50 ln(2/δ_bin)/(ε² n)``."""
        return 1.0 - 50.0 * math.log(2.0 / self.bin_delta) / (self.eps**2 * self.n)


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


class ZSum(IndexHistogram[ZSumParams]):
    """The Balcer–Cheu zero-sum histogram through the mechanism interface.

    It has no dominating pair (its noise is calibrated to a declared crowd, Theorem 12), so
    :meth:`epoch_pair` finds none and the ledger composes each epoch's certificate.
    """

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    randomizer_type = BalcerCheuNoise

    def parse_params(self, raw: Mapping[str, Any]) -> ZSumParams:
        return ZSumParams(**raw)

    def domain_size(self, params: ZSumParams) -> int:
        return params.d

    def fragment_limit(self, params: ZSumParams) -> int:
        return params.d + 1

    def fragment_count(self, params: ZSumParams, batch: BatchContext) -> FragmentCount:
        """The user's own message plus Bin(d, p) noise messages (Figure 2)."""
        p = params.noise_prob
        return FragmentCount(1, params.d + 1, 1.0 + params.d * p, params.d * p * (1.0 - p))

    def encode_value(self, params: ZSumParams, value: int, rng: RandomSource) -> list[bytes]:
        """``b_j + Ber(p)`` messages "j" for every bin j (Figure 2)."""
        value = check_value(value, params.d)
        p = params.noise_prob
        messages = [value]
        messages.extend(j for j in range(params.d) if bernoulli(rng, p))
        return [index_fragment(MECHANISM_CODE, j) for j in sorted(messages)]

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

    def local_privacy(self, params: ZSumParams) -> LocalPrivacy:
        """None: a user's own messages reveal its value (the privacy is all in the shuffle)."""
        return LocalPrivacy(
            removal=math.inf,
            replacement=math.inf,
            eps_l_inf=math.inf,
            eps_l1=math.inf,
            note="no local privacy (multi-message)",
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
