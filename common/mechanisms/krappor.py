"""k-RAPPOR with attribute fragments — ESA-revisited Algorithm 1, §III (MECHANISMS.md §1).

Binary randomized response on each bit of the one-hot encoding (flip ``p = 1/(1 + e^ε)``;
removal ε-LDP, replacement 2ε); only the indices of the 1-bits are sent, one fragment each,
drawn by geometric skipping in O(k p). Wire payload (code 1): ``uint32 bit index``. Estimator
``ĉ_j = ((e^ε + 1) S_j - n) / (e^ε - 1)`` (ESA-revisited §III). Central privacy (removal, per
attribute): Lemma II.6, Theorem III.1 and the binary-RR blanket bound.

Details: docs/mechanisms.md, "k-RAPPOR with attribute fragments".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.accounting import BinaryRR
from common.mechanisms._estimates import (
    CountAccumulator,
    Estimate,
    FloatArray,
    IntArray,
    clip_estimate,
)
from common.mechanisms._histogram import (
    IndexHistogram,
    check_bins,
    check_eps,
    check_value,
    index_fragment,
)
from common.mechanisms._random import bit_law, randomized_onehot
from common.mechanisms.base import BatchContext, FragmentCount, LocalPrivacy, PrivacyDescription
from common.randomness import RandomSource

NAME = "krappor"
MECHANISM_CODE = 1
PAYLOAD_SIZE = 4


@dataclass(frozen=True, slots=True)
class KRapporParams:
    """Attributes: ``k`` domain size, ``eps`` per-bit ε (removal)."""

    k: int
    eps: float

    def __post_init__(self) -> None:
        check_bins("k", self.k)
        check_eps("eps", self.eps)

    @property
    def flip_prob(self) -> float:
        """``p = 1/(1 + e^ε)``."""
        return 1.0 / (1.0 + math.exp(self.eps))

    def expected_fragments(self) -> float:
        """Expected fragments per report: ``(1 - p) + (k - 1) p``."""
        p = self.flip_prob
        return (1.0 - p) + (self.k - 1) * p


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


class KRappor(IndexHistogram[KRapporParams]):
    """k-RAPPOR with attribute fragments through the mechanism interface."""

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    randomizer_type = BinaryRR

    def parse_params(self, raw: Mapping[str, Any]) -> KRapporParams:
        return KRapporParams(**raw)

    def domain_size(self, params: KRapporParams) -> int:
        return params.k

    def fragment_limit(self, params: KRapporParams) -> int:
        return params.k

    def fragment_count(self, params: KRapporParams, batch: BatchContext) -> FragmentCount:
        """The true bit kept w.p. 1 - p plus Bin(k - 1, p) false ones, whatever the value."""
        p = params.flip_prob
        return FragmentCount(0, params.k, params.expected_fragments(), params.k * p * (1.0 - p))

    def encode_value(self, params: KRapporParams, value: int, rng: RandomSource) -> list[bytes]:
        """Fragments of one report, sorted by bit index (the order reveals nothing)."""
        value = check_value(value, params.k)
        ones = randomized_onehot(rng, value, params.k, params.flip_prob)
        return [index_fragment(MECHANISM_CODE, index) for index in ones]

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

    def local_privacy(self, params: KRapporParams) -> LocalPrivacy:
        """Removal ε, replacement 2ε; every fragment is a post-processing of the whole report."""
        return LocalPrivacy(
            removal=params.eps,
            replacement=2.0 * params.eps,
            eps_l_inf=params.eps,
            eps_l1=params.eps,
            note="per-bit binary RR",
        )

    def bin_count_law(self, params: KRapporParams, value: int, bins: tuple[int, int]) -> FloatArray:
        """Each bit is binary RR of its own attribute, independently (Algorithm 1)."""
        return np.outer(*(bit_law(value == b, params.flip_prob) for b in bins))

    def privacy(self, params: KRapporParams) -> PrivacyDescription:
        """Per-bit binary RR at ε (removal, per attribute; blanket pair, Balle et al. 2019)."""
        return PrivacyDescription(BinaryRR(), params.eps)
