"""Lower bound for honesty: exact shuffled binary randomized response (FMT21 Appendix F).

The minimal ε at δ for the pair ``X0 = (0, ..., 0)``, ``X1 = (1, 0, ..., 0)`` (ones counted,
FMT21 eq. (22)) bounds from below what any analysis can certify for a mechanism containing
that pair (generic ε0-DP bounds; k-RAPPOR under removal). Shown beside certificates, never
certified: truncation and rounding only lower it, and the search returns the left end of its
bracket (FMT21 Algorithm 6, Proposition F.1). Details: docs/accounting.md, "The 2RR lower
bound".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import stats

from common.accounting._checks import check_count, check_positive, check_probability
from common.accounting.hockey_stick import ABS_TOL, REL_TOL, ROUNDING_SLACK, tail_window
from common.accounting.results import BoundResult, Method, Neighbouring

#: The bound ids this module's bounds carry (:meth:`common.accounting.results.Method.declare`).
LOWER_2RR = Method.declare(
    "lower-2rr",
    "the exact shuffled binary-RR lower bound (FMT21 Appendix F), never certified",
    "lower",
)


#: Probability mass left out on each side of the evaluated window (only lowers δ: safe here).
LOWER_TAIL = 1e-30


@lru_cache(maxsize=256)
def _pmfs(n: int, eps0: float) -> tuple[np.ndarray, np.ndarray]:
    p = 1.0 / (math.exp(eps0) + 1.0)
    lo, hi = tail_window(n, p, LOWER_TAIL)
    support = np.arange(max(lo - 1, 0), min(hi + 1, n) + 1, dtype=np.int64)
    pmf0 = stats.binom.pmf(support, n, p)
    pmf1 = p * stats.binom.pmf(support, n - 1, p) + (1.0 - p) * stats.binom.pmf(
        support - 1, n - 1, p
    )
    return pmf0, pmf1


def two_rr_delta(n: int, eps0: float, eps: float) -> float:
    """FMT21 eq. (22): ``D_{e^ε}`` between c0 and c1 (both directions), deflated."""
    pmf0, pmf1 = _pmfs(n, eps0)
    factor = math.exp(eps)
    forward = float(np.sum(np.maximum(pmf0 - factor * pmf1, 0.0)))
    backward = float(np.sum(np.maximum(pmf1 - factor * pmf0, 0.0)))
    return max(forward, backward) * (1.0 - ROUNDING_SLACK)


@lru_cache(maxsize=2048)
def _lower_eps(n: int, eps0: float, delta: float) -> float:
    lo, hi = 0.0, eps0
    if two_rr_delta(n, eps0, 0.0) <= delta:
        return 0.0
    while hi - lo > ABS_TOL + REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        if two_rr_delta(n, eps0, mid) < delta:
            hi = mid
        else:
            lo = mid
    return lo


def lower_2rr(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """FMT21 Appendix F lower bound for shuffled binary RR (``kind="lower"``).

    Raises:
        ValueError: on n < 1, δ outside (0, 1), ε0 <= 0, NaN or inf.
    """
    eps0 = check_positive("eps0", eps0)
    n = check_count("n", n)
    delta = check_probability("delta", delta)
    return BoundResult(
        eps=_lower_eps(n, eps0, delta),
        delta=delta,
        method=LOWER_2RR,
        neighbouring=neighbouring,
        inputs=(("eps0", eps0), ("n", n), ("delta", delta)),
        valid_regime=True,
        note="lower bound (exact shuffled binary RR); never certified",
        kind="lower",
    )
