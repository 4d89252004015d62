"""LDP-SGD, the device facet — ESA-revisited §VI, Algorithm 4, with the paper's PRG
communication reduction.

A device reports ``tau`` signs of its clipped gradient against sphere directions regenerated
from 128-bit seeds, each flipped with probability ``1/(1 + e^ε)`` (OS CSPRNG). Wire payload
(code 6): ``uint32 round | uint8 sign | 16-byte seed``. The vector arithmetic (the seed-to-sphere
sampler, clipping, Algorithm 4 itself) is :mod:`common.mechanisms.device._ldpsgd`, which needs
numpy and loads with an LDP-SGD channel's first report; the server's averaging and the privacy
argument are :mod:`common.mechanisms.ldpsgd`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from common.mechanisms.device import (
    BatchContext,
    DeviceMechanism,
    DeviceState,
    Encoded,
    FragmentCount,
    LocalPrivacy,
    ValueKind,
)
from common.mechanisms.device._histogram import check_eps
from common.randomness import RandomSource

if TYPE_CHECKING:
    from common.mechanisms._estimates import FloatArray

NAME = "ldp-sgd"
MECHANISM_CODE = 6
SEED_BYTES = 16
PAYLOAD_SIZE = 4 + 1 + SEED_BYTES
SPHERE_DOMAIN = b"esa/ldp-sgd/sphere/v1"
#: Keys of a channel's ``params`` that carry the published model, not parameters.
MODEL_KEYS = ("round", "theta")


@dataclass(frozen=True, slots=True)
class LdpSgdParams:
    """Attributes: ``dim`` model dimension d, ``eps`` per-report ε (replacement), ``clip`` the
    L2 clipping norm L, ``radius`` of the parameter ball C, ``learning_rate`` η, ``tau``
    reports per device per round, ``rounds`` T."""

    dim: int
    eps: float
    clip: float = 1.0
    radius: float = 100.0
    learning_rate: float = 1.0
    tau: int = 1
    rounds: int = 1

    def __post_init__(self) -> None:
        for name in ("dim", "tau", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")
        if self.dim < 2:
            raise ValueError(f"dim must be >= 2, got dim={self.dim}")
        check_eps("eps", self.eps)
        for name in ("clip", "radius", "learning_rate"):
            check_eps(name, getattr(self, name))

    @property
    def flip_prob(self) -> float:
        """``1/(1 + e^ε)``."""
        return 1.0 / (1.0 + math.exp(self.eps))

    @property
    def scale(self) -> float:
        """Algorithm 5 line 5's constant with the factor d (docs/mechanisms.md, "LDP-SGD")."""
        return self.dim * paper_scale(self.dim, self.clip, self.eps)


def paper_scale(dim: int, clip: float, eps: float) -> float:
    """The constant as printed in Algorithm 5 line 5:
    ``L √π/2 · Γ((d-1)/2 + 1)/Γ(d/2 + 1) · (e^ε + 1)/(e^ε - 1)``."""
    gamma_ratio = math.exp(math.lgamma((dim - 1) / 2 + 1) - math.lgamma(dim / 2 + 1))
    return clip * math.sqrt(math.pi) / 2 * gamma_ratio / math.tanh(eps / 2)


@dataclass(frozen=True, slots=True)
class GradientReport:
    """What a device hands the SDK: the round of the model it used and its gradient there."""

    round: int
    gradient: FloatArray


class LdpSgdDevice(DeviceMechanism[LdpSgdParams]):
    """LDP-SGD as a device runs it: ``tau`` one-bit reports of its gradient per round."""

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    value_kind: ClassVar[ValueKind] = ValueKind.CATEGORY

    def parse_params(self, raw: Mapping[str, Any]) -> LdpSgdParams:
        return LdpSgdParams(**{k: v for k, v in raw.items() if k not in MODEL_KEYS})

    def domain_size(self, params: LdpSgdParams) -> int:
        return params.dim

    def fragment_limit(self, params: LdpSgdParams) -> int:
        return params.tau

    def fragment_count(self, params: LdpSgdParams, batch: BatchContext) -> FragmentCount:
        """Every report is ``tau`` fragments (Algorithm 4)."""
        return FragmentCount.exactly(params.tau)

    def encode(
        self,
        params: LdpSgdParams,
        value: Any,
        state: DeviceState | None,
        rng: RandomSource,
        shufflers: int,
    ) -> Encoded:
        """Algorithm 4 (:func:`common.mechanisms.device._ldpsgd.encode`, numpy: loaded here,
        by an LDP-SGD channel's first report, not by the SDK's import)."""
        from common.mechanisms.device._ldpsgd import encode

        return Encoded(((None, tuple(encode(value, params, rng))),))

    def local_privacy(self, params: LdpSgdParams) -> LocalPrivacy:
        """Per round: ``tau`` reports of ε each (replacement, basic composition — exact for pure
        ε); removal against a uniform sign: ``ln(2e^ε/(e^ε + 1))`` per report."""
        removal = math.log(2.0 / (1.0 + math.exp(-params.eps)))
        return LocalPrivacy(
            removal=params.tau * removal,
            replacement=params.tau * params.eps,
            eps_l_inf=params.tau * removal,
            eps_l1=removal,
            note=f"{params.tau} binary-RR report(s) per device per round",
        )
