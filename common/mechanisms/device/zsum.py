"""Balcer–Cheu zero-sum histogram, the device facet — *Separating Local & Shuffled DP*,
Figures 1–2, Theorem 12.

For every bin j a user sends ``b_j + Ber(p)`` copies of "j", ``p`` fixed by the channel's
*declared* crowd and per-bin δ (δ/2: the histogram is (2ε, δ)-DP, replacement); configurations
outside Theorem 11's regime are refused, and the domain is capped at ``MAX_BINS``. Wire
payload (code 4): ``uint32 bin``. Estimate and central privacy: :mod:`common.mechanisms.zsum`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.mechanisms.device import BatchContext, FragmentCount, LocalPrivacy
from common.mechanisms.device._histogram import (
    IndexEncoder,
    check_bins,
    check_value,
    index_fragment,
)
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


class ZSumDevice(IndexEncoder[ZSumParams]):
    """The Balcer–Cheu zero-sum histogram as a device runs it: no local privacy by design."""

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    shuffle_only = True

    def parse_params(self, raw: Mapping[str, Any]) -> ZSumParams:
        return ZSumParams(**raw)

    def domain_size(self, params: ZSumParams) -> int:
        return params.d

    def fragment_limit(self, params: ZSumParams) -> int:
        return params.d + 1

    def fragment_count(self, params: ZSumParams, batch: BatchContext) -> FragmentCount:
        """The user's own message plus Bin(d, p) noise messages (Figure 2): d independent
        coins of one message each beside the fixed one."""
        p = params.noise_prob
        return FragmentCount(
            minimum=1,
            maximum=params.d + 1,
            mean=1.0 + params.d * p,
            variance=params.d * p * (1.0 - p),
            piece=1,
        )

    def encode_value(self, params: ZSumParams, value: int, rng: RandomSource) -> list[bytes]:
        """``b_j + Ber(p)`` messages "j" for every bin j (Figure 2)."""
        value = check_value(value, params.d)
        p = params.noise_prob
        messages = [value]
        messages.extend(j for j in range(params.d) if bernoulli(rng, p))
        return [index_fragment(MECHANISM_CODE, j) for j in sorted(messages)]

    def local_privacy(self, params: ZSumParams) -> LocalPrivacy:
        """None: a user's own messages reveal its value (the privacy is all in the shuffle)."""
        return LocalPrivacy(
            removal=math.inf,
            replacement=math.inf,
            eps_l_inf=math.inf,
            eps_l1=math.inf,
            note="no local privacy (multi-message)",
        )
