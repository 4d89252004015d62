"""Argument validation shared by every public accounting function.

Each check raises ``ValueError`` naming the offending argument and its value, in the style
of ``dp_accounting``.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def _finite_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {name}={value!r}")
    as_float = float(value)
    if math.isnan(as_float) or math.isinf(as_float):
        raise ValueError(f"{name} must be finite, got {name}={value!r}")
    return as_float


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` as an int, requiring an integer >= ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    if isinstance(value, Integral):
        as_int = int(value)
    elif isinstance(value, Real) and math.isfinite(float(value)) and float(value).is_integer():
        as_int = int(float(value))
    else:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    if as_int < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    return as_int


def check_positive(name: str, value: object) -> float:
    """Return ``value`` as a float, requiring a finite number > 0."""
    as_float = _finite_real(name, value)
    if as_float <= 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")
    return as_float


def check_non_negative(name: str, value: object) -> float:
    """Return ``value`` as a float, requiring a finite number >= 0."""
    as_float = _finite_real(name, value)
    if as_float < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value!r}")
    return as_float


def check_probability(name: str, value: object) -> float:
    """Return ``value`` as a float, requiring it to lie in the open interval (0, 1)."""
    as_float = _finite_real(name, value)
    if not 0.0 < as_float < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {name}={value!r}")
    return as_float


def check_unit_interval(name: str, value: object) -> float:
    """Return ``value`` as a float, requiring it to lie in the closed interval [0, 1]."""
    as_float = _finite_real(name, value)
    if not 0.0 <= as_float <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {name}={value!r}")
    return as_float
