"""Small pieces shared by the mechanism modules: local privacy and uint32 fragment parsing."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from common.mechanisms._estimates import CountAccumulator, IntArray
from common.mechanisms._wire import FragmentError, frame, unframe

UINT32_LIMIT = 1 << 32


@dataclass(frozen=True, slots=True)
class LocalPrivacy:
    """Local ε of one device's report, in both neighbouring notions.

    Attributes:
        removal: ε against the reference "no data" report (ESA-revisited Definition II.4).
        replacement: ε against any other value.
        eps_l_inf: Removal ε when an adversary sees every fragment (ESA-revisited §VII).
        eps_l1: Removal ε when an adversary sees a single fragment.
        note: What the numbers mean for this mechanism.
    """

    removal: float
    replacement: float
    eps_l_inf: float
    eps_l1: float
    note: str = ""


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


def add_index_fragments(
    accumulator: CountAccumulator,
    code: int,
    k: int,
    fragments: Iterable[bytes],
    n_contributions: int,
) -> int:
    """Count one batch of uint32-index fragments; returns how many were invalid (chaff)."""
    indices, invalid = parse_indices(code, k, fragments)
    accumulator.add(indices, n_contributions)
    return invalid


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
