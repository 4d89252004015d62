"""The device side of the index histograms (k-RAPPOR, k-RR and Balcer–Cheu report uint32 bin
indices), and the argument checks every mechanism's parameters use."""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from numbers import Integral
from typing import Any, ClassVar

from common.mechanisms._wire import frame
from common.mechanisms.device import DeviceMechanism, DeviceState, Encoded, MechanismError, P
from common.randomness import RandomSource

UINT32_LIMIT = 1 << 32


def _integer(value: object) -> bool:
    """An integer (numpy's too: they register as :class:`numbers.Integral`), never a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_bins(name: str, value: int, limit: int = UINT32_LIMIT) -> int:
    """Validate a domain size (>= 2, fits the uint32 wire format)."""
    if not _integer(value) or not 2 <= value < limit:
        raise ValueError(f"{name} must be an integer in [2, {limit}), got {name}={value!r}")
    return int(value)


def check_eps(name: str, value: float) -> float:
    """Validate a local ε (finite, > 0)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")
    return float(value)


def check_value(value: int, k: int) -> int:
    """Validate a categorical value against its domain [0, k)."""
    if not _integer(value) or not 0 <= value < k:
        raise ValueError(f"value must be an integer in [0, {k}), got value={value!r}")
    return int(value)


def index_fragment(code: int, index: int) -> bytes:
    """A fragment whose payload is one uint32 index."""
    return frame(code, int(index).to_bytes(4, "big"))


@dataclass(frozen=True, slots=True)
class DomainParams:
    """A domain size ``k`` (>= 2, uint32) and a local ``eps`` (finite, > 0), both checked on
    construction: the parameters k-RAPPOR (ESA-revisited Algorithm 1) and k-RR (Hiding Among
    the Clones §4.1) share; each subclass says what its ``eps`` means."""

    k: int
    eps: float

    def __post_init__(self) -> None:
        check_bins("k", self.k)
        check_eps("eps", self.eps)


class IndexEncoder(DeviceMechanism[P]):
    """A mechanism whose fragments are uint32 bin indices, one contribution per report
    (k-RAPPOR, k-RR, Balcer–Cheu): the value checked against the domain, then encoded."""

    payload_size: ClassVar[int] = 4

    @abstractmethod
    def encode_value(self, params: P, value: int, rng: RandomSource) -> list[bytes]:
        """The fragments of one report of ``value`` (already checked against the domain)."""

    def encode(
        self, params: P, value: Any, state: DeviceState | None, rng: RandomSource, shufflers: int
    ) -> Encoded:
        try:
            checked = check_value(value, self.domain_size(params))
        except ValueError as error:
            raise MechanismError(str(error)) from error
        return Encoded(((None, tuple(self.encode_value(params, checked, rng))),))
