"""Index histograms (k-RAPPOR, k-RR and Balcer–Cheu share them) and the argument checks
every mechanism module uses."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from common.accounting import Certification
from common.mechanisms._estimates import CountAccumulator, IntArray
from common.mechanisms._wire import FragmentError, frame, unframe
from common.mechanisms.base import (
    BatchContext,
    DeviceState,
    Encoded,
    Mechanism,
    MechanismError,
    P,
    Received,
    ReleaseCertificate,
    certify_smallest_batch,
)
from common.randomness import RandomSource

UINT32_LIMIT = 1 << 32


def check_bins(name: str, value: int, limit: int = UINT32_LIMIT) -> int:
    """Validate a domain size (>= 2, fits the uint32 wire format)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 2 <= value < limit:
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
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < k:
        raise ValueError(f"value must be an integer in [0, {k}), got value={value!r}")
    return int(value)


def index_fragment(code: int, index: int) -> bytes:
    """A fragment whose payload is one uint32 index."""
    return frame(code, int(index).to_bytes(4, "big"))


def parse_indices(code: int, k: int, fragments: Iterable[bytes]) -> tuple[IntArray, int]:
    """Parse uint32-index fragments; return the valid indices and the number of invalid ones."""
    valid: list[int] = []
    invalid = 0
    for fragment in fragments:
        try:
            index = int.from_bytes(unframe(code, 4, fragment), "big")
        except FragmentError:
            invalid += 1
            continue
        if index >= k:
            invalid += 1
            continue
        valid.append(index)
    return np.asarray(valid, dtype=np.int64), invalid


class IndexHistogram(Mechanism[P, CountAccumulator]):
    """A histogram mechanism whose fragments are uint32 bin indices, one contribution each
    (k-RAPPOR, k-RR, Balcer–Cheu): encoding, accumulation and certification shared."""

    payload_size: ClassVar[int] = 4

    @abstractmethod
    def encode_value(self, params: P, value: int, rng: RandomSource) -> list[bytes]:
        """The fragments of one report of ``value`` (already checked against the domain)."""

    def certify_crowd(self, params: P, n: int, delta: float) -> Certification:
        """The certificate of one batch of n contributions."""
        return self.privacy(params).certify(n, delta)

    def encode(
        self, params: P, value: Any, state: DeviceState | None, rng: RandomSource, shufflers: int
    ) -> Encoded:
        try:
            checked = check_value(value, self.domain_size(params))
        except ValueError as error:
            raise MechanismError(str(error)) from error
        return Encoded(((None, tuple(self.encode_value(params, checked, rng))),))

    def new_accumulator(self, params: P) -> CountAccumulator:
        return CountAccumulator.empty(self.domain_size(params))

    def load_accumulator(self, params: P, data: bytes) -> CountAccumulator:
        return CountAccumulator.from_bytes(data)

    def accumulate(
        self,
        params: P,
        accumulator: CountAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Count one batch of uint32-index fragments; returns how many were invalid (chaff)."""
        indices, invalid = parse_indices(self.code, self.domain_size(params), fragments)
        accumulator.add(indices, n_contributions)
        return invalid

    def certify(
        self, params: P, delta: float, received: Sequence[Received[CountAccumulator]]
    ) -> ReleaseCertificate:
        return certify_smallest_batch(received, lambda n: self.certify_crowd(params, n, delta))
