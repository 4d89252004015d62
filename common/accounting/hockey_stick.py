"""Rigorous numerical hockey-stick divergence for shuffled ε0-DP reports.

Implements Feldman, McMillan, Talwar, *Hiding Among the Clones* (FMT21), Appendix E (Lemma E.1,
Lemma E.2, Algorithms 3–5), on the clone pair of Remark 3.5, eq. (20), with clone probability
``r = e^-ε0`` (any ε0-DP randomizer), ``2/(e^ε0 + 1)`` (binary RR: the privacy blanket, Balle
et al. 2019) or ``2/(e^ε0 + k - 1)`` with weight ``w`` (k-RR). Exact over the relevant range of
the clone count and an upper bound elsewhere: blocks are charged at their left end (Lemma E.2),
tails the largest value ``B(0)``, and rounding can only raise δ; :func:`eps_for_delta` returns
the right end of its final bracket (Algorithm 3), so the returned ε is certified.

Derivation and error allowances: docs/accounting.md, "Hockey-stick divergence of the clone
pair".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt
from scipy import special, stats

from common.accounting._checks import check_count, check_positive, check_probability

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
DeltaFunction = Callable[[float], float]

#: Blocks are about sqrt(c)/GRID_SQRT_DIVISIONS wide (Lemma E.2 makes grouping safe); clone
#: counts below GRID_SQRT_DIVISIONS² are evaluated one by one.
GRID_SQRT_DIVISIONS = 64
#: Mass of C left outside the evaluated window, as a fraction of the target δ.
TAIL_FRACTION = 1e-9
#: Relative error allowed for Boost's binomial pmf and incomplete beta (measured <= 2e-12 at
#: c = 5e8 by tests/accounting/test_brute_force.py::test_library_accuracy_at_huge_counts).
LIBRARY_REL_ERROR = 5e-12
#: Relative inflation of every computed δ, covering floating-point rounding.
ROUNDING_SLACK = 1e-11
#: Stopping rule of the ε search: bracket width <= ABS_TOL + REL_TOL · ε.
ABS_TOL = 1e-12
REL_TOL = 1e-10


@dataclass(frozen=True, slots=True)
class ClonePair:
    """The reduced pair of FMT21 eq. (20) with a general clone probability.

    Attributes:
        n_others: Number of other users, ``n - 1``.
        clone_prob: Probability ``r`` that another user's report is a clone.
        eps0: The target's randomized-response parameter (``q = e^ε0 / (e^ε0 + 1)``).
        weight: Weight ``w`` of the informative component (1 except for k-RR).
    """

    n_others: int
    clone_prob: float
    eps0: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_count("n_others", self.n_others, minimum=0)
        check_positive("eps0", self.eps0)
        if not 0.0 <= self.clone_prob <= 1.0 or math.isnan(self.clone_prob):
            raise ValueError(f"clone_prob must be in [0, 1], got clone_prob={self.clone_prob!r}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got weight={self.weight!r}")


@dataclass(frozen=True, slots=True)
class _Blocks:
    """Blocks of clone counts with their probability mass; ``starts`` are left ends."""

    starts: IntArray
    masses: FloatArray
    tail_mass: float


def _block_edges(lo: int, hi: int) -> IntArray:
    """Left ends of the grid blocks that meet [lo, hi]; the first is clipped to lo.

    The grid is ``c_j = floor(j² / (4 S²))`` with ``S = GRID_SQRT_DIVISIONS``: consecutive
    points are about ``sqrt(c)/S`` apart, a fixed fraction of the standard deviation of any
    binomial clone count near ``c``, and the grid does not depend on n or ε0. Below ``S²`` the
    spacing is under one, so every clone count is its own block there.
    """
    scale = 4.0 * GRID_SQRT_DIVISIONS**2
    j_lo = math.floor(math.sqrt(lo * scale))
    j_hi = math.ceil(math.sqrt((hi + 1) * scale)) + 1
    js = np.arange(j_lo, j_hi + 1, dtype=np.float64)
    points = np.floor(js * js / scale).astype(np.int64)
    points = points[(points >= lo) & (points <= hi)]
    return np.unique(np.concatenate([np.array([lo], dtype=np.int64), points]))


def _window_mass(m: int, r: float, lo: IntArray, hi: IntArray) -> FloatArray:
    """Pr[lo <= Bin(m, r) <= hi] per row, via cdf below the mean and sf above it."""
    mean = m * r
    below = hi < mean
    from_cdf = stats.binom.cdf(hi, m, r) - stats.binom.cdf(lo - 1, m, r)
    from_sf = stats.binom.sf(lo - 1, m, r) - stats.binom.sf(hi, m, r)
    masses: FloatArray = np.asarray(
        np.clip(np.where(below, from_cdf, from_sf), 0.0, 1.0), np.float64
    )
    return masses


def tail_window(m: int, r: float, tail: float) -> tuple[int, int]:
    """[lo, hi] with Pr[Bin(m, r) < lo] <= tail and Pr[Bin(m, r) > hi] <= tail.

    Found by integer bisection on scipy's ``cdf`` and ``sf``, which stay accurate far into
    the tails (``ppf``/``isf`` do not at probabilities near 1e-20).
    """
    mode = min(max(math.floor((m + 1) * r), 0), m)
    a, b = mode, m
    while a < b:
        mid = (a + b) // 2
        if stats.binom.sf(mid, m, r) <= tail:
            b = mid
        else:
            a = mid + 1
    hi = a
    a, b = 0, mode
    while a < b:
        mid = (a + b + 1) // 2
        if stats.binom.cdf(mid - 1, m, r) <= tail:
            a = mid
        else:
            b = mid - 1
    return a, hi


@lru_cache(maxsize=256)
def _blocks(m: int, r: float, tail: float) -> _Blocks:
    if r <= 0.0 or m == 0:
        return _Blocks(np.zeros(1, np.int64), np.ones(1), 0.0)
    if r >= 1.0:
        return _Blocks(np.array([m], np.int64), np.ones(1), 0.0)
    lo, hi = tail_window(m, r, tail)
    starts = _block_edges(lo, hi)
    ends = np.append(starts[1:] - 1, hi)
    masses = _window_mass(m, r, starts, ends)
    tail_mass = (
        float(stats.binom.cdf(lo - 1, m, r) + stats.binom.sf(hi, m, r))
        if lo > 0
        else float(stats.binom.sf(hi, m, r))
    )
    return _Blocks(starts, masses, tail_mass)


def _alpha_beta(eps: float, eps0: float) -> tuple[float, float, float]:
    """α, β of Lemma E.1 and the threshold ratio α/(α+β), computed without cancellation."""
    q = 1.0 / (1.0 + math.exp(-eps0))
    alpha = -math.expm1(eps - eps0) * q
    beta = math.expm1(eps + eps0) / (1.0 + math.exp(eps0))
    ratio = -math.expm1(eps - eps0) / (-math.expm1(-eps0) * (1.0 + math.exp(eps)))
    return alpha, beta, ratio


def clone_divergence(c: IntArray, eps: float, eps0: float) -> FloatArray:
    """``B(c)`` of FMT21 Algorithm 4 / Lemma E.1 for every clone count in ``c``.

    The hockey-stick divergence ``D_{e^ε}(P_c || Q_c)`` between ``Bin(c,1/2) + Bern(1-q)`` and
    ``Bin(c,1/2) + Bern(q)``, for ``0 <= ε < ε0``, plus an allowance for library error.

    ``α F(m) - β F(m-1)`` is evaluated as ``α A(m) - (e^ε - 1) F(m-1)`` (``α - β = 1 - e^ε``),
    which avoids subtracting two numbers near ``α F(m)``; ``F`` comes from Boost's regularized
    incomplete beta (``scipy.special.betainc``) and ``A`` from Boost's binomial pmf. (Cephes'
    ``bdtr`` was measured 1e-4 off near the median at c = 5e8, enough to break Lemma E.2.)
    """
    alpha, _, ratio = _alpha_beta(eps, eps0)
    growth = math.expm1(eps)
    c = np.asarray(c, dtype=np.int64)
    m = np.clip(np.ceil((c + 1) * ratio).astype(np.int64) - 1, 0, c)
    a_m = np.asarray(stats.binom.pmf(m, c, 0.5), dtype=np.float64)
    below = np.maximum(c - m + 1, 1).astype(np.float64)
    f_below = np.where(
        m >= 1, special.betainc(below, np.maximum(m, 1).astype(np.float64), 0.5), 0.0
    )
    a_minus = np.where(m >= 1, a_m * m / below, 0.0)
    a_plus = np.where(m + 1 <= c, a_m * (c - m) / (m + 1), 0.0)
    f_two_below = np.maximum(f_below - a_minus, 0.0)
    f_at = f_below + a_m
    t_at = alpha * a_m - growth * f_below
    t_minus = alpha * a_minus - growth * f_two_below
    t_plus = alpha * a_plus - growth * f_at
    best = np.maximum(np.maximum(t_at, t_minus), np.maximum(t_plus, 0.0))
    allowance = LIBRARY_REL_ERROR * (
        alpha * np.maximum(a_m, np.maximum(a_minus, a_plus)) + growth * f_at
    )
    result: FloatArray = np.asarray(best + allowance, dtype=np.float64)
    return result


def delta_for_eps(pair: ClonePair, eps: float, delta_target: float) -> float:
    """An upper bound on ``δ(ε)`` for the pair, exact up to ``ROUNDING_SLACK`` in the window.

    Args:
        pair: The reduced pair.
        eps: The ε at which to evaluate the hockey-stick divergence (>= 0).
        delta_target: The δ the caller will compare against; it sets the tail window.

    Returns:
        A number >= the true ``D_{e^ε}(P || Q)``.
    """
    if eps >= pair.eps0:
        return 0.0
    blocks = _blocks(pair.n_others, pair.clone_prob, TAIL_FRACTION * delta_target)
    alpha = _alpha_beta(eps, pair.eps0)[0]
    inside = float(np.dot(blocks.masses, clone_divergence(blocks.starts, eps, pair.eps0)))
    total = pair.weight * (inside + alpha * blocks.tail_mass)
    return min(total * (1.0 + ROUNDING_SLACK), 1.0)


def _search_right_end(delta_fn: DeltaFunction, eps_max: float, delta_target: float) -> float:
    """Smallest ε in [0, eps_max] with ``delta_fn(ε) <= delta_target``, rounded up.

    ``delta_fn`` must be non-increasing and ``delta_fn(eps_max) <= delta_target``. The search
    keeps the bracket invariant ``delta_fn(lo) > target >= delta_fn(hi)`` and returns ``hi``.
    Steps are regula falsi on ``log δ`` with the Illinois modification, falling back to
    bisection whenever the interpolation stalls.
    """
    lo, hi = 0.0, eps_max
    d_lo = delta_fn(lo)
    if d_lo <= delta_target:
        return 0.0
    log_target = math.log(delta_target)
    f_lo = math.log(d_lo) - log_target
    d_hi = delta_fn(hi)
    f_hi = math.log(d_hi) - log_target if d_hi > 0 else -math.inf
    side = 0
    while hi - lo > ABS_TOL + REL_TOL * hi:
        width = hi - lo
        if math.isfinite(f_hi) and f_lo > f_hi:
            x = hi - f_hi * width / (f_hi - f_lo)
            x = min(max(x, lo + 0.02 * width), hi - 0.02 * width)
        else:
            x = lo + 0.5 * width
        d_x = delta_fn(x)
        f_x = math.log(d_x) - log_target if d_x > 0 else -math.inf
        if f_x <= 0:
            hi, f_hi = x, f_x
            if side == -1:
                f_lo *= 0.5
            side = -1
        else:
            lo, f_lo = x, f_x
            if side == 1 and math.isfinite(f_hi):
                f_hi *= 0.5
            side = 1
    return hi


@lru_cache(maxsize=4096)
def eps_for_delta(pair: ClonePair, delta: float) -> float:
    """The certified ε of the pair at ``delta`` (FMT21 Algorithm 3, Proposition E.3).

    Args:
        pair: The reduced pair.
        delta: Target δ in (0, 1).

    Returns:
        The right end of the final search bracket: an ε with ``δ(ε) <= delta``, never above
        ``pair.eps0``.
    """
    check_probability("delta", delta)
    return _search_right_end(lambda e: delta_for_eps(pair, e, delta), pair.eps0, delta)


def search_right_end(delta_fn: DeltaFunction, eps_max: float, delta_target: float) -> float:
    """The certified bracketing search, for other non-increasing δ(ε) curves."""
    return _search_right_end(delta_fn, eps_max, delta_target)
