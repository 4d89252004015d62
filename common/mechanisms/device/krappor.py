"""k-RAPPOR with attribute fragments, the device facet — ESA-revisited Algorithm 1, §III.

Binary randomized response on each bit of the one-hot encoding (flip ``p = 1/(1 + e^ε)``;
removal ε-LDP, replacement 2ε); only the indices of the 1-bits are sent, one fragment each,
drawn by geometric skipping in O(k p). Wire payload (code 1): ``uint32 bit index``. Estimator
and central privacy: :mod:`common.mechanisms.krappor`; docs/mechanisms.md, "k-RAPPOR with
attribute fragments".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.mechanisms.device import BatchContext, FragmentCount, LocalPrivacy
from common.mechanisms.device._histogram import (
    DomainParams,
    IndexEncoder,
    check_value,
    index_fragment,
)
from common.mechanisms.device._random import randomized_onehot
from common.randomness import RandomSource

NAME = "krappor"
MECHANISM_CODE = 1
PAYLOAD_SIZE = 4


@dataclass(frozen=True, slots=True)
class KRapporParams(DomainParams):
    """Attributes: ``k`` domain size, ``eps`` per-bit ε (removal)."""

    @property
    def flip_prob(self) -> float:
        """``p = 1/(1 + e^ε)``."""
        return 1.0 / (1.0 + math.exp(self.eps))

    def expected_fragments(self) -> float:
        """Expected fragments per report: ``(1 - p) + (k - 1) p``."""
        p = self.flip_prob
        return (1.0 - p) + (self.k - 1) * p


class KRapporDevice(IndexEncoder[KRapporParams]):
    """k-RAPPOR with attribute fragments as a device runs it."""

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE

    def parse_params(self, raw: Mapping[str, Any]) -> KRapporParams:
        return KRapporParams(**raw)

    def domain_size(self, params: KRapporParams) -> int:
        return params.k

    def fragment_limit(self, params: KRapporParams) -> int:
        return params.k

    def fragment_count(self, params: KRapporParams, batch: BatchContext) -> FragmentCount:
        """The true bit kept w.p. 1 - p plus Bin(k - 1, p) false ones, whatever the value: k
        independent bits, one fragment each."""
        p = params.flip_prob
        return FragmentCount(
            minimum=0,
            maximum=params.k,
            mean=params.expected_fragments(),
            variance=params.k * p * (1.0 - p),
            piece=1,
        )

    def encode_value(self, params: KRapporParams, value: int, rng: RandomSource) -> list[bytes]:
        """Fragments of one report, sorted by bit index (the order reveals nothing)."""
        value = check_value(value, params.k)
        ones = randomized_onehot(rng, value, params.k, params.flip_prob)
        return [index_fragment(MECHANISM_CODE, index) for index in ones]

    def local_privacy(self, params: KRapporParams) -> LocalPrivacy:
        """Removal ε, replacement 2ε; every fragment is a post-processing of the whole report."""
        return LocalPrivacy(
            removal=params.eps,
            replacement=2.0 * params.eps,
            eps_l_inf=params.eps,
            eps_l1=params.eps,
            note="per-bit binary RR",
        )
