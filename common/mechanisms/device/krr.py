"""k-ary randomized response, the device facet — Hiding Among the Clones §4.1.

With probability ``(e^ε - 1)/(e^ε + k - 1)`` the true value is sent, otherwise a uniform value
in [0, k): the true value is reported w.p. ``a = e^ε/(e^ε + k - 1)``, each other value w.p.
``b = 1/(e^ε + k - 1)`` (replacement ε-LDP). One message per report; wire payload ``uint32
value`` (mechanism code 5). Estimator and central privacy: :mod:`common.mechanisms.krr`.
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
from common.randomness import RandomSource, bernoulli

NAME = "krr"
MECHANISM_CODE = 5
PAYLOAD_SIZE = 4


@dataclass(frozen=True, slots=True)
class KRRParams(DomainParams):
    """Attributes: ``k`` domain size, ``eps`` replacement ε."""

    @property
    def truth_prob(self) -> float:
        """``a = e^ε/(e^ε + k - 1)``."""
        return 1.0 / (1.0 + (self.k - 1) * math.exp(-self.eps))

    @property
    def other_prob(self) -> float:
        """``b = 1/(e^ε + k - 1)``."""
        return 1.0 / (math.exp(self.eps) + self.k - 1)


class KRRDevice(IndexEncoder[KRRParams]):
    """k-ary randomized response as a device runs it."""

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE

    def parse_params(self, raw: Mapping[str, Any]) -> KRRParams:
        return KRRParams(**raw)

    def fragment_count(self, params: KRRParams, batch: BatchContext) -> FragmentCount:
        """Every report is one message (§4.1)."""
        return FragmentCount.exactly(1)

    def domain_size(self, params: KRRParams) -> int:
        return params.k

    def encode_value(self, params: KRRParams, value: int, rng: RandomSource) -> list[bytes]:
        """One fragment: the value or, with probability k/(e^ε + k - 1), a uniform value."""
        value = check_value(value, params.k)
        keep = math.expm1(params.eps) * params.other_prob
        reported = value if bernoulli(rng, keep) else rng.randbelow(params.k)
        return [index_fragment(MECHANISM_CODE, reported)]

    def local_privacy(self, params: KRRParams) -> LocalPrivacy:
        """Replacement ε; removal against the uniform reference ``ln(k e^ε/(e^ε + k - 1))``."""
        removal = math.log(params.k * params.truth_prob)
        return LocalPrivacy(
            removal=removal,
            replacement=params.eps,
            eps_l_inf=removal,
            eps_l1=removal,
            note="single message",
        )
